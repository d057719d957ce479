"""What the agents send in: events (one path for every batch) and the ranks' output."""
