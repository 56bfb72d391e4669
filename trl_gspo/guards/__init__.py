"""What watches and protects a run: guards, diagnostics, checkpoints and resume.

`nonfinite` (the non-finite guard), `rewards_guard` (checks on what reward functions return), `diagnostics` (the
`Diagnostics` part) and `checkpointing` (complete-or-ignored checkpoints, signal saves, exact resume).

May import: `trl_gspo.common`, `trl_gspo.losses`; not the other feature folders.
"""
