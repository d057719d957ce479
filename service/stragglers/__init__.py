"""Stragglers: the ranks their peers wait for, scored as their timings arrive, and what a job's policy does."""
