"""Whether a path lies inside a folder, as the file system will see it: links followed and `..`
resolved. The service (at submit), the agent (at launch) and the library (at resume) all ask."""

import os
from pathlib import Path


def inside(path: str | os.PathLike, area: str | os.PathLike) -> bool:
    """`path` resolves to `area` or below it."""
    resolved, root = Path(os.path.realpath(path)), Path(os.path.realpath(area))
    return resolved == root or root in resolved.parents
