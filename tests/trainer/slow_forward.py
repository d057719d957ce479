"""`python -m trainer.train` where one rank computes slower: rank $SLOW_FORWARD_RANK sleeps
$SLOW_FORWARD_SECONDS in each transformer block's forward, after FSDP2 has gathered the block's
parameters, as a slow device would compute (tests/trainer/test_compute_timing.py)."""

import os
import runpy
import time

from trainer.model import TransformerBlock

if __name__ == "__main__":  # the suite's warm server imports it first (tests/support/warm.py)
    if os.environ.get("RANK") == os.environ["SLOW_FORWARD_RANK"]:
        seconds, forward = float(os.environ["SLOW_FORWARD_SECONDS"]), TransformerBlock.forward

        def slow_forward(self, *args):
            time.sleep(seconds)
            return forward(self, *args)

        TransformerBlock.forward = slow_forward  # type: ignore[method-assign]
    runpy.run_module("trainer.train", run_name="__main__")
