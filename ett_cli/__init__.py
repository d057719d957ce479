"""The `ett` command line."""
