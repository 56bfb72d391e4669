"""The forward path: every log-prob forward as one pipeline.

`pipeline` (the `LogprobForward` part), `planner` (`plan_forward`, the cost model) and its layouts: where each position of a model call
comes from (`layouts`), trimmed, sorted and packed rows and micro-batches (`padding`), each group's prompt run once
(`shared_prefix`), the attention of packed calls (`segment_attention`) and the tile width of TRL's fused head
(`fused_head`).

May import: `trl_gspo.common`, `trl_gspo.losses`; not the other feature folders.
"""
