"""ETT for any training script: `import ett`, then `run = ett.init()` (docs/library.md).

The library's names are loaded on first use (PEP 562): they bring in torch, which the `ett`
command (ett_cli) and the service it starts do not need.
"""

import importlib
from typing import TYPE_CHECKING, Any

from ett.errors import UsageError

if TYPE_CHECKING:
    from ett.protocol import EXIT_STOPPED
    from ett.run import Run, Step, Stopped, init
    from ett.state import ModelOptimizerState, RNGState

__all__ = ["EXIT_STOPPED", "ModelOptimizerState", "RNGState", "Run", "Step", "Stopped", "UsageError", "init"]
_WHERE = {"init": "ett.run", "Run": "ett.run", "Step": "ett.run", "Stopped": "ett.run", "EXIT_STOPPED": "ett.protocol",
          "ModelOptimizerState": "ett.state", "RNGState": "ett.state"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'ett' has no attribute {name!r}")
