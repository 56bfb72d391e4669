"""MoE routing: routers found and hooked, routes recorded and replayed.

`routing` (router hooks, route tables, gate weights per architecture), `route_sources` (R3's sampler routes from
transformers, vLLM and `rollout_func` outputs) and `routing_replay` (the `MoERouting` part, `R2` / `R3`, `moe/*`
metrics).

May import: `trl_gspo.common`, `trl_gspo.losses`; not the other feature folders.
"""
