"""Pydantic request and response models (requests reject unknown fields: service.spec.Strict, the
base they share with the job spec, which sits below the models that store it)."""

import re

# A validator's message that names a field deeper than its own: "faults.1.rank: rank 9 ...".
NESTED_FIELD = re.compile(r"^Value error, ((?:\w+\.)*\w+): (.*)$", re.S)


def field_and_message(field: str, message: str) -> tuple[str, str]:
    """The field a validation error is about, and its message: a validator of `field` may name a
    field inside it by starting its message with a path from its own name ("env.PYTHONPATH: ..."
    for `env`, "options.3: ..." for `slurm.options`)."""
    nested = NESTED_FIELD.match(message)
    if nested is None:
        return field, message
    head, _, own = field.rpartition(".")
    if nested[1].split(".")[0] != own:
        return field, message
    return (f"{head}." if head else "") + nested[1], nested[2]
