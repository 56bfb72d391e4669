"""The shared bottom: what every path uses and nothing else.

`validation` (the one error style of config checks), `metrics` (diagnostic statistics and `MetricWindow`),
`trl_compat` (the supported TRL range and every TRL-internal name used), `imports` (dotted import paths resolved)
and `model_card` (what a saved model's card says: the trainer writes it at save time, so it sits below the trainer).

May import: `trl_gspo.losses` and third-party packages only; nothing else of trl_gspo.
"""
