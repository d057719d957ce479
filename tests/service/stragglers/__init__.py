"""Slow time and stragglers: the rule, scoring, the policy, nodes across jobs."""
