"""ETT service."""
