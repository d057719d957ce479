"""ETT agent."""
