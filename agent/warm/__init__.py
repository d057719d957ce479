"""Warm start: servers that imported torch once and fork ranks, the asking side, and the agent's keeping of them."""
