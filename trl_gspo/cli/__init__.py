"""The command line and what only it uses: `trl-gspo demo | train | check | recipes | models`.

`commands` (the entry point `main`, the five commands, the `accelerate launch` relaunch), `parser` (TRL's parser
with recipe key and type checks), `shipped` (shipped recipes and configs by name, `extends`), `recipe_inputs` (what
a recipe points at, checked before any model loads), `rewards` (the CLI's reward functions), `resources` (processes,
devices and threads, said at start), `run_notes` (one-line notes around start-up), `run_model` (the model a run
loads, decided once for every rank), `failures` (how a run that fails or is stopped reports it), `console`, `demo`
and `addition` (its tasks), `models` (`trl-gspo models`), `check` and `parity` (the parity cases it runs against
stock TRL). The tiny models and tokenizer the demo and check use are `trl_gspo.testing`; the rounding bounds the
parity cases compare with are `trl_gspo.rounding`.

May import: everything below it (`trl_gspo.trainer`, `trl_gspo.config`, the feature folders, `trl_gspo.common`).
Nothing in trl_gspo imports `trl_gspo.cli`.
"""

from .commands import main

__all__ = ["main"]
