"""The agent's own word on a job's checkpoints: whether a committed one is on disk as its event says."""
