"""Why an attempt failed: diagnosis from the ranks' output, and its text for people."""
