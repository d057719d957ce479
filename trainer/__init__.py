"""ETT trainer."""
