"""The names in the job's folders the forwarder lists at every pass (events/, logs/), listed again
only when the folder changed: a job may lay tens of thousands of files there, and the forwarder
passes ten times a second. A folder's ctime moves whenever a name is added or removed, and no
process can set it back (it moves with utime too), so the job cannot hide a new file. The clock
that stamps it is coarse (a few milliseconds): a listing is kept only once its folder's ctime is
a second old, so a file made in the same tick as the listing is never missed.
"""

import os
import stat
import time
from pathlib import Path

SETTLED_NS = 1_000_000_000


class Listings:
    def __init__(self) -> None:
        self._seen: dict[Path, tuple[tuple[int, int, int], list[str]]] = {}

    def names(self, folder: Path) -> list[str]:
        """The names in `folder`, sorted; [] when it is not a folder of its own (a link, gone)."""
        try:
            st = os.lstat(folder)
            if not stat.S_ISDIR(st.st_mode):
                return []
            mark = (st.st_ino, st.st_mtime_ns, st.st_ctime_ns)
            seen = self._seen.get(folder)
            if seen is not None and seen[0] == mark:
                return seen[1]
            names = sorted(os.listdir(folder))
        except OSError:
            return []
        if time.time_ns() - st.st_ctime_ns >= SETTLED_NS:
            self._seen[folder] = (mark, names)
        return names

    def forget(self, under: Path) -> None:
        """The folders at or under `under` are gone."""
        self._seen = {k: v for k, v in self._seen.items() if not k.is_relative_to(under)}
