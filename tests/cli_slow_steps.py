"""The `trl-gspo` CLI with a pause after each optimizer step (STEP_PAUSE seconds, default 0.3), so that a test can send
a signal in the middle of a run of the tiny demo, whose steps take a few milliseconds."""

import os
import sys
import time

from transformers.trainer_callback import CallbackHandler

from trl_gspo.cli.commands import main

_on_step_end = CallbackHandler.on_step_end


def _paused_step_end(self, args, state, control):
    time.sleep(float(os.environ.get("STEP_PAUSE", "0.3")))
    return _on_step_end(self, args, state, control)


CallbackHandler.on_step_end = _paused_step_end

if __name__ == "__main__":
    sys.exit(main())
