"""The rollout path: how a scored rollout batch is produced.

`pipeline` (the `RolloutPipeline` part, `SynchronousRollouts`, sampling apart from scoring); its other sources:
`dynamic_sampling` (with its filter and filling policy, `group_filling`) and `async_rollouts` (with the generator
thread and backends, `async_backends` and `async_server`, and its options, `async_options`); the registry that picks one from the
config (`sources`); `prompt_stream` (TRL's prompt order computed ahead) and `sampler_logprobs` (the sampler's
log-probs reused as pi_old).

May import: `trl_gspo.moe` (generation records routes), `trl_gspo.common`, `trl_gspo.losses`. Inside the folder,
`pipeline` never imports its sources; `sources` (above them) picks one.
"""
