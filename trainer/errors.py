"""The trainer's documented exit codes (docs/trainer.md) and the error that maps to code 3."""

from ett.errors import UsageError

EXIT_OK = 0
EXIT_FAILED = 1  # an exception: a failure, retried by the service
EXIT_CONFIG_ERROR = 3  # bad preset, override or value: retrying cannot help, the service never does
EXIT_STOPPED = 4  # SIGTERM: stopped after the current step and a final checkpoint


class ConfigError(UsageError):
    """A configuration the trainer cannot run with; the message names the field."""
