"""This node's files as the agent keeps them: an attempt's spool, link-safe job folders, shared JSON lines."""
