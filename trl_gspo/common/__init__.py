"""The shared bottom: what every path uses and nothing else.

`validation` (the one error style of config checks), `metrics` (diagnostic statistics and `MetricWindow`),
`trl_compat` (the supported TRL range and every TRL-internal name used), `seam` (the overrides and runtime patches on
TRL), `engine` (what DeepSpeed and FSDP do with the weights), `optimizers` (optimizers that need a package),
`imports` (dotted import paths resolved), `model_config` (what is read of a model's config), `model_card` (what a
saved model's card says: the trainer writes it at save time, so it sits below the trainer), and the model store:
`model_store` (where a known Hub model comes from), `model_prepare` (the offline copy made from a GGUF) and
`hub_files` (the Hub cache's files for a model).

May import: `trl_gspo.losses` and third-party packages only; nothing else of trl_gspo.
"""
