"""ETT for any training script: `import ett`, then `run = ett.init()` (docs/library.md)."""

from ett.errors import UsageError
from ett.run import Run, Step, init
from ett.state import ModelOptimizerState, RNGState

__all__ = ["ModelOptimizerState", "RNGState", "Run", "Step", "UsageError", "init"]
