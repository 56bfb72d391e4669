"""What watches and protects a run: guards, diagnostics, checkpoints and resume.

`nonfinite` (the non-finite guard), `rewards_guard` (checks on what reward functions return), `diagnostics` (the
`Diagnostics` part), `checkpointing` (complete-or-ignored checkpoints, signal saves, exact resume), `precision`
(bf16 weights without fp32 master weights: upcast, refused or allowed) and `weight_updates` (`weights_changed`).

May import: `trl_gspo.common`, `trl_gspo.losses`; not the other feature folders.
"""
