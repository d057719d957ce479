"""The error that the trainer exits with EXIT_CONFIG_ERROR for (ett/protocol: the exit codes)."""

from ett.errors import UsageError


class ConfigError(UsageError):
    """A configuration the trainer cannot run with; the message names the field."""
