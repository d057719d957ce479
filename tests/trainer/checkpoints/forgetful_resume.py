"""`python -m trainer.train`, with the restore of each rank's generators made a no-op: what a
resume that forgot the RNG state would do. tests/trainer/checkpoints/test_resume.py shows that the bitwise
resume test notices."""

import runpy

from ett.state import RNGState

if __name__ == "__main__":  # the suite's warm server imports it first (tests/support/warm.py)
    RNGState.load_state_dict = lambda self, state: None  # type: ignore[method-assign]
    runpy.run_module("trainer.train", run_name="__main__")
