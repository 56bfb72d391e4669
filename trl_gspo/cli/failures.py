"""How `main` reports a run that fails or is stopped once training has started (mistakes found before are
`RecipeError`s, one line, exit 2):

- a reward function that raises: the frames of the user's own function (the reward guard's, TRL's, transformers'
  and ours above it are no help to fix it), then the guard's `RewardFunctionError` line naming the function and the
  sample, last; exit 1.
- Ctrl-C: the signal checkpoint's one line (where it saved, how to resume), exit 130 (128 + SIGINT), as a shell
  reports a command Ctrl-C stopped; a second Ctrl-C, which does not wait for the checkpoint, says that nothing was
  saved for it.
- an output folder the failed run created and left empty (HF's Trainer creates it when it is built) is removed, so a
  failure leaves nothing half-written behind; a folder holding anything (a checkpoint) is kept.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback

from ..guards import rewards_guard
from ..guards.checkpointing import StoppedBySignal

#: Exit status of a command stopped by Ctrl-C (128 + SIGINT), and of a run failed by the user's reward function.
INTERRUPTED, REWARD_FAILED = 130, 1


def reward_failure(error: BaseException) -> rewards_guard.RewardFunctionError | None:
    """The `RewardFunctionError` that `error` is or was raised from (the generator thread of an asynchronous run
    re-raises it as its cause), or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, rewards_guard.RewardFunctionError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def user_frames(error: rewards_guard.RewardFunctionError) -> list[str]:
    """The traceback of the exception the reward function raised, from the function's own frame down (the guard's
    frame above it left out), with its last line when the guard's message does not already say it; [] for a reward
    that returned a bad value (nothing raised)."""
    cause = error.__cause__
    if cause is None or cause.__traceback__ is None:
        return []
    frames = traceback.extract_tb(cause.__traceback__)
    guard = os.path.abspath(rewards_guard.__file__)
    while frames and os.path.abspath(frames[0].filename) == guard:
        frames = frames[1:]
    if not frames:
        return []
    lines = ["Traceback of the reward function (most recent call last):\n", *traceback.format_list(frames)]
    last = traceback.format_exception_only(type(cause), cause)[-1]
    return lines if last.strip() in str(error) else [*lines, last]


def report_reward_failure(command: str, error: rewards_guard.RewardFunctionError) -> int:
    print("".join(user_frames(error)) + f"trl-gspo {command}: error: {error}", file=sys.stderr, flush=True)
    return REWARD_FAILED


def report_interrupt(command: str, error: KeyboardInterrupt) -> int:
    if isinstance(error, StoppedBySignal):
        text = (
            f"stopped by SIGINT (Ctrl-C) after step {error.step}; checkpoint saved to {error.checkpoint}. To continue, run the "
            "same command with --resume_from_checkpoint true."
        )
    else:
        text = "interrupted (Ctrl-C); no checkpoint was saved for this interruption."
    print(f"trl-gspo {command}: {text}", file=sys.stderr, flush=True)
    return INTERRUPTED


@contextlib.contextmanager
def removed_if_left_empty(folder: str):
    """On any exception (Ctrl-C included), remove `folder` if it did not exist before the block and holds no file
    (folders inside it only) afterwards; then re-raise."""
    existed = os.path.exists(folder)
    try:
        yield
    except BaseException:
        if not existed:
            _remove_empty_tree(folder)
        raise


def _remove_empty_tree(folder: str) -> None:
    for root, _, _ in sorted(os.walk(folder), key=lambda entry: -len(entry[0])):  # the deepest folders first
        with contextlib.suppress(OSError):  # not empty, or another process removed it first
            os.rmdir(root)
