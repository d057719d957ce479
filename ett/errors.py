"""The one error the library raises for a caller's mistake; its message names what is wrong."""


class UsageError(ValueError):
    """A misuse of the library, or a setting it cannot work with (a step number going backwards,
    a checkpoint folder that cannot be written, a checkpoint written by another world size)."""
