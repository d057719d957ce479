"""Jobs kept apart end to end: hostile jobs, leftovers, owners' users."""
