"""`MoERouting`: MoE routes observed in the forwards TRL runs, and replayed when `GSPOConfig.routing_replay` asks.

Which routes pi_old used, per rollout batch. After generation TRL runs at most two forwards over the rollout batch
(pi_old, then the reference) and one loss forward per micro-batch. The `MoERouting` part (held by the trainer, called
by the rollout and forward paths) opens a :class:`routing.RouterPass` on exactly two of them: the first log-prob call
inside `_generate_and_score_completions` when TRL needs pi_old (its no-grad pi_old pass; never the reference
forward, which runs the same modules under PEFT), and the loss forward (`loss_forward`, opened by the loss). The routes pi_old's forward used ride along in the rollout batch as `old_routes` /
`old_routes_valid` (compact ids and a validity mask; TRL shuffles and splits them with every other per-row tensor):

| `routing_replay` | pi_old forward                    | loss forward                 | `old_routes` hold          |
|------------------|-----------------------------------|------------------------------|----------------------------|
| `"none"`         | native, recorded (completion)     | native                       | pi_old's own picks         |
| `"R2"`           | native, recorded (prompt + compl.) | replays `old_routes`         | pi_old's own picks         |
| `"R3"`           | replays the sampler's routes      | replays `old_routes`         | the sampler's picks        |

R3's sampler routes come from transformers `generate` (recorded during prefill and decoding), from vLLM
(`enable_return_routed_experts`, colocate and server mode) or from a `rollout_func` that returns `routed_experts`
(`moe/route_sources.py`). Positions without a route (padding, the last sampled token, prefix-cache hits) route natively.

Replayed forwards keep their replay armed through the backward, so gradient checkpointing recomputes each layer on the
same routes; `training_step` / `prediction_step` disarm it when they return, so `generate()` always routes natively.

Metrics, through the diagnostics window (pooled per logging step): `moe/routing_shift` (+ `_any_layer`,
`moe/expert_change`): the current router's own top-k vs the routes pi_old's forward used, per completion token and
MoE layer, so under replay it shows what replay corrected; `moe/expert_load_cv` (native picks); `moe/replay/coverage`
(share of completion tokens whose route was replayed); R3: `moe/r3/sampler_mismatch` (+ `_any_layer`), the same
comparison on mini-batches still at the sampler's weights, i.e. sampler vs trainer routing; `moe/replay/route_mb`
(routes held for the current rollout batch, per process).

The MoE load-balancing loss stays native under replay: transformers computes it from the router logits (re-running
top-k on them), and the replay hook returns those logits unchanged. Balancing the router's own choices is what keeps
future rollouts balanced; the replayed routes are history the router can no longer change.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from ..common import metrics, seam, trl_compat
from ..common.model_config import text_config
from ..common.validation import check_choice
from .route_sources import (
    ServerResponses,
    place_routes,
    routes_from_engine,
    routes_from_generate,
    server_returns_routes,
    vllm_routes_from_outputs,
)
from .routing import RouterHooks, RouterPass, RouteTable

logger = logging.getLogger(__name__)

#: MoE routing replay modes.
ROUTING_REPLAY_MODES = ("none", "R2", "R3")

#: When vLLM returns routes at all: the checks of vLLM's `VllmConfig._verify_aux_output_compatibility`
#: (vllm/config/vllm.py; tests/config/test_aux_output_config.py) refuse `enable_return_routed_experts` otherwise.
VLLM_ROUTES_PRECONDITIONS = (
    "vLLM returns routes only with Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1 where it is not the default), prefix "
    "caching on (--enable-prefix-caching), no pipeline or context parallelism (pipeline_parallel_size, "
    "decode_context_parallel_size and prefill_context_parallel_size all 1), no KV connector, and a generating MoE "
    "model; check the vLLM server's or engine's start-up log. Model Runner V2 needs Triton: vLLM's CPU build refuses "
    "--enable-return-routed-experts (0.31: 'Model Runner V2 requires Triton'), so R3 with vLLM needs a CUDA build."
)


@dataclass
class RoutingReplayOptions:
    r"""
    `GSPOConfig` field of MoE routing replay (this module).

    Parameters:
        routing_replay (`str`, *optional*, defaults to `"none"`):
            `"none"`: every forward routes natively (the GSPO paper's setting). `"R2"`: record the top-k experts of
            every token in TRL's pi_old forward and force them in the loss forward (the paper's "Routing Replay"
            baseline for GRPO); needs that forward, i.e. off-policy mini-batches (`steps_per_generation >
            gradient_accumulation_steps` or `num_iterations > 1`) and `old_logprobs_source="recompute"`. `"R3"`:
            record the sampler's routes while generating (transformers `generate`, vLLM with
            `enable_return_routed_experts`, or a `rollout_func` returning `routed_experts`) and force them in the
            pi_old and loss forwards, removing the sampler/trainer routing mismatch. Works with every
            `importance_sampling_level`. Gate weights are recomputed from the current router logits at the forced
            experts, so the router keeps training; the load-balancing loss stays on the router's own picks.
    """

    routing_replay: str = field(
        default="none",
        metadata={
            "help": "MoE routing replay. 'none' (default, the GSPO paper: GSPO needs no replay). 'R2': replay the "
            "experts chosen in TRL's pi_old forward in the loss forward (the paper's GRPO baseline). 'R3': replay the "
            "sampler's experts in the pi_old and loss forwards (removes the sampler/trainer routing mismatch).",
            "choices": list(ROUTING_REPLAY_MODES),
        },
    )

    def _validate_options(self):
        mode = self.routing_replay
        check_choice("routing_replay", mode, ROUTING_REPLAY_MODES)
        if mode == "R2":
            old_pass = trl_compat.old_logprob_pass_runs(
                self.steps_per_generation,
                self.num_iterations,
                self.gradient_accumulation_steps,
                bool(self.use_vllm and self.vllm_importance_sampling_correction),
            )
            if not old_pass:
                raise ValueError(
                    f"routing_replay='R2' records routes in TRL's pi_old forward, which does not run here: with "
                    f"steps_per_generation={self.steps_per_generation} <= gradient_accumulation_steps="
                    f"{self.gradient_accumulation_steps} and num_iterations={self.num_iterations} every mini-batch is "
                    "on-policy, so the loss forward already routes exactly as pi_old did and replay would change "
                    "nothing. Use several mini-batches per rollout (e.g. steps_per_generation = 4 * "
                    "gradient_accumulation_steps) or routing_replay='none'."
                )
            if self.old_logprobs_source == "sampler":
                raise ValueError(
                    "routing_replay='R2' records routes in TRL's pi_old forward, which old_logprobs_source='sampler' "
                    "skips. Use routing_replay='R3' (the sampler's routes, consistent with the sampler's log-probs) or "
                    "old_logprobs_source='recompute'."
                )
        if mode != "none" and self.use_liger_kernel:
            raise ValueError(
                f"routing_replay={mode!r} replays routes in TRL's log-prob forward, which use_liger_kernel=True replaces "
                "by Liger's fused loss; set use_liger_kernel=False or routing_replay='none'."
            )
        if mode == "R3" and self.use_transformers_continuous_batching:
            raise ValueError(
                "routing_replay='R3' needs the sampler's expert routes, which transformers continuous batching "
                "(use_transformers_continuous_batching=True) does not expose; use generate, vLLM, or routing_replay='R2'."
            )


class MoERouting:
    """MoE routing metrics, and routing replay (R2 / R3) when `routing_replay` asks for it (module docstring).

    Built by the trainer with the router hooks of its model (None for a dense model, or with diagnostics off and no
    replay: then every step here does nothing). The rollout path calls the `*_rollout` and `keep_*` steps around
    TRL's generation and scoring, the forward path the router-pass steps around each log-prob forward, and the loss
    opens `loss_forward` around its own."""

    def __init__(self, run, replay: str, hooks: RouterHooks | None, model_config, diagnostics):
        self.run, self.replay, self.hooks = run, replay, hooks  # run: trainer.RunView
        self.model_config = text_config(model_config)
        self.diagnostics = diagnostics  # guards/diagnostics.py: the window the loss forward's metrics go to
        self.role = None  # "old" or "loss" while one of the two observed forwards is next; None otherwise
        self.loss_inputs = None  # the micro-batch of the running loss forward
        self.at_sampler_weights = False  # the running loss forward's weights sampled its micro-batch
        self.sampler_routes = None  # R3: per-completion routes of the rollout being scored (moe/route_sources.py)
        self.rollout_routes = None  # RouteTable of pi_old's routes for the rollout being scored
        self.old_pass_logps = None  # the log-probs of the observed pi_old forward (to pair them with TRL's pi_old)
        self.vllm_routes = None  # R3 with vLLM: the routes of the last generation call, this process's completions

    # ------------------------------------------------------------------------------------------------ set-up
    def check(self, tools=None) -> None:
        """Refuse replay on a model or a generation path it cannot serve (before the first step)."""
        if self.replay == "none":
            return
        name = getattr(self.model_config, "model_type", type(self.model_config).__name__)
        if self.hooks is None:
            raise ValueError(
                f"routing_replay={self.replay!r} needs a Mixture-of-Experts model, but {name!r} has no expert routers; "
                "use routing_replay='none' for dense models."
            )
        self.hooks.check_replay_supported("routing_replay", self.replay)
        if self.replay == "R3" and tools:
            raise ValueError(
                "routing_replay='R3' records the sampler's routes of one generation call; multi-turn tool completions "
                "(tools / environment_factory) interleave tool output the sampler never routed. Use routing_replay='R2'."
            )

    def capture_vllm_routes(self, generation, accelerator) -> None:
        """R3 with vLLM: keep the routes the engine (colocate) or the server returns with each of TRL's generation
        calls, this process's completions in TRL's order (`keep_sampler_routes` reads them). Server mode: TRL gathers
        every process's prompts, only the main process has a client (`vllm_client`) and talks to the server, then
        broadcasts the completions: the routes are read from the main process's client and broadcast the same way."""
        seen = {"raw": None}
        if getattr(generation, "mode", None) == "colocate":
            seam.on_engine_outputs(generation.llm, lambda outputs: seen.update(raw=vllm_routes_from_outputs(outputs)))
        elif not trl_compat.vllm_server_returns_routes():  # decided from TRL's client class: the same on every rank
            raise ValueError(
                f"routing_replay='R3' with vllm_mode='server': this TRL ({trl_compat.installed_trl_version()}) talks "
                "to `trl vllm-serve`'s own endpoint, whose responses carry no expert routes. Use vllm_mode='colocate', "
                "a TRL whose client calls vLLM's server directly (1.14.2 and 1.16 do), or routing_replay='R2'."
            )
        elif getattr(generation, "vllm_client", None) is not None:  # TRL creates the client on the main process only
            client, responses = generation.vllm_client, ServerResponses()
            if server_returns_routes(client) is False:  # said now, not at the first rollout
                raise ValueError(
                    f"routing_replay='R3' with vllm_mode='server': the vLLM server at {client.base_url} was started "
                    "without --enable-return-routed-experts, so its replies carry no expert routes. Restart it with the "
                    f"flag (`trl vllm-serve --model ... --enable-return-routed-experts`). {VLLM_ROUTES_PRECONDITIONS}"
                )

            def keep(url, payload, response):
                responses.keep(url, payload, response)
                seen["raw"] = responses.routes()

            seam.on_server_responses(client, responses.start, keep)

        def after(prompts):
            self.vllm_routes = this_process_routes(seen["raw"], prompts, generation, accelerator)

        seam.around_vllm_generate(generation, lambda: seen.update(raw=None), after)

    # ------------------------------------------------------------------ sampler routes (R3), the rollout path
    @property
    def records_sampler_routes(self) -> bool:
        """R3 logs the router calls of TRL's `generate` path (every row's, prefill included)."""
        return self.replay == "R3" and self.run.sampling_path == "generate"

    def recording_sampler_routes(self):
        """Context for one generation call of TRL's `generate` path: under R3, a log of the router calls (else None)."""
        return self.hooks.log_calls() if self.records_sampler_routes else contextlib.nullcontext()

    def keep_sampler_routes(self, prompt_ids, completion_ids, log) -> None:
        """After one generation call: R3's routes of this call's completions, from the router log or from vLLM."""
        if log is not None:
            lengths = [len(ids) for ids in prompt_ids], [len(ids) for ids in completion_ids]
            self.sampler_routes = (routes_from_generate(log, len(prompt_ids), *lengths), *lengths)
        elif self.replay == "R3" and self.run.sampling_path == "vllm":
            self.sampler_routes = self._ingest(self.vllm_routes, prompt_ids, completion_ids, "vLLM")

    def keep_earlier_routes(self, sampler_routes) -> None:
        """R3's routes of completions sampled earlier (`Generation.sampler_routes`: the rollout pipeline scores them
        now), or None before a generation that records its own."""
        self.sampler_routes = sampler_routes

    def keep_generated_routes(self, prompt_ids, completion_ids, routes) -> None:
        """R3 routes recorded by another copy of the model (rollout/async_rollouts.py's generator): one tensor per
        completion, as `routes_from_generate` returns them."""
        if self.replay == "R3":
            if routes is None or len(routes) != len(completion_ids):
                raise RuntimeError("routing_replay='R3': the generator returned no routes for these completions.")
            self.sampler_routes = (routes, [len(p) for p in prompt_ids], [len(c) for c in completion_ids])

    def keep_rollout_func_routes(self, outputs) -> None:
        """After TRL's `_generate`: R3's routes returned by a `rollout_func` (`routed_experts`), and the check that R3
        got routes from whichever path generated."""
        prompt_ids, completion_ids, extra_fields = outputs[0], outputs[1], outputs[5]
        if self.replay == "R3" and self.run.sampling_path == "rollout_func":
            raw = extra_fields.pop("routed_experts", None)  # not a reward-function column
            if raw is None:
                raise ValueError(
                    "routing_replay='R3' with a rollout_func needs it to return 'routed_experts' (one [tokens, layers, "
                    "top_k] array per completion, layouts as in trl_gspo.moe.route_sources.routes_from_engine)."
                )
            self.sampler_routes = self._ingest(raw, prompt_ids, completion_ids, "rollout_func")
        if self.replay == "R3" and self.sampler_routes is None:
            raise RuntimeError("routing_replay='R3' but this generation path returned no routes.")

    def _ingest(self, raw, prompt_ids, completion_ids, where):
        hooks = self.hooks
        if raw is None or len(raw) != len(completion_ids):
            raise ValueError(
                f"routing_replay='R3': {where} returned routes for {0 if raw is None else len(raw)} completions, the "
                f"batch has {len(completion_ids)} (vLLM: start it with enable_return_routed_experts / "
                f"--enable-return-routed-experts; {VLLM_ROUTES_PRECONDITIONS})"
            )
        layers = [r.decoder_layer for r in hooks.routers]
        routes = [
            routes_from_engine(
                r,
                len(p),
                len(c),
                layers,
                self.model_config.num_hidden_layers,
                hooks.top_k,
                hooks.num_experts,
                f"{where} completion {i}",
            )
            for i, (r, p, c) in enumerate(zip(raw, prompt_ids, completion_ids, strict=True))
        ]
        return routes, [len(p) for p in prompt_ids], [len(c) for c in completion_ids]

    # ----------------------------------------------------------------------------- a rollout batch, scored
    def begin_rollout(self) -> None:
        """Before TRL scores a rollout batch: observe its pi_old pass (when TRL runs one), nothing else."""
        self.release()
        self.sampler_routes, self.rollout_routes = None, None
        self.role = "old" if self.hooks is not None and self.run.old_pass_runs else None
        self.old_pass_logps = None

    def end_rollout(self) -> None:
        self.role = None

    def attach(self, output: dict) -> None:
        """Put pi_old's routes (R3: the sampler's) into the scored rollout batch as `old_routes` / `old_routes_valid`,
        per row like every other rollout tensor, so TRL's shuffle and split carry them to each micro-batch."""
        if self.replay == "R3":
            table = self._rollout_table(output["prompt_ids"].size(1), output["completion_ids"].size(1))
        elif self.old_pass_logps is not None and output.get("old_per_token_logps") is self.old_pass_logps:
            table = self.rollout_routes  # recorded in the forward whose log-probs TRL kept as pi_old
        else:
            table = None  # no pi_old forward ran (on-policy, or pi_old from the sampler): no routes to pair with it
        if table is not None:
            output["old_routes"], output["old_routes_valid"] = table.ids, table.valid
            self.run.log_metric("moe/replay/route_mb", table.nbytes / 2**20)
        self.sampler_routes, self.rollout_routes = None, None

    def _rollout_table(self, prompt_width, completion_width) -> RouteTable:
        """R3: the sampler's routes in the rollout batch's layout (built once per rollout batch)."""
        if self.rollout_routes is None:
            routes, prompt_lens, completion_lens = self.sampler_routes
            self.rollout_routes = place_routes(
                routes, prompt_lens, completion_lens, prompt_width, completion_width, self.hooks.id_dtype
            )
        return self.rollout_routes

    # ------------------------------------------------------------------------------------------ the forwards
    @contextlib.contextmanager
    def loss_forward(self, inputs: dict, at_sampler_weights: bool):
        """Around the loss of one micro-batch: its forward is observed (replayed under R2 / R3, metrics recorded).
        `at_sampler_weights`: the weights that sampled the micro-batch are the current ones (R3's mismatch metric)."""
        observed = self.hooks is not None
        self.role, self.loss_inputs = ("loss", inputs) if observed else (None, None)
        self.at_sampler_weights = at_sampler_weights
        try:
            yield
        finally:
            self.role, self.loss_inputs = None, None

    def release(self) -> None:
        """The step's forwards and backward are done: replayed routes are disarmed (generate() routes natively)."""
        if self.hooks is not None:
            self.hooks.release()

    # Steps of the forward pipeline (forward/pipeline.py): which forward this is, the router pass around it, what it
    # recorded.
    def take_role(self) -> str | None:
        """ "old" (TRL's pi_old pass), "loss" (the loss forward) or None: one observed forward per role."""
        role, self.role = self.role, None
        return role

    @contextlib.contextmanager
    def route_pass(self, role, replay, batch, width):
        """The router pass of one observed forward. Not observed (`role` None): a pass opened around this forward by
        the caller, if any, so its model calls still say which positions they hold; else None."""
        if role is None:
            current = None if self.hooks is None else self.hooks.active
            yield current if isinstance(current, RouterPass) and not current.closed else None
            return
        record = not (role == "old" and self.replay == "R3")  # R3's pi_old routes are the sampler's, already known
        with self.hooks.forward_pass(
            batch, width, record=record, replay=replay, keep_for_recompute=torch.is_grad_enabled()
        ) as observed:
            yield observed

    def after_route_pass(self, role, replay, observed, out, logits_to_keep) -> None:
        """Keep pi_old's routes for the rollout batch, or record the loss forward's routing metrics."""
        if observed.idle:
            return  # no model call ran: nothing observed
        problem = observed.check()
        if problem is not None:
            if self.replay != "none":  # replay would force routes onto the wrong tokens, or have none to force
                raise RuntimeError(f"routing_replay={self.replay!r}: {problem}; routes cannot be replayed reliably.")
            logger.warning("MoE routing metrics skipped for this forward: %s.", problem)
            return
        native = observed.native_routes()
        if role == "old":
            self.old_pass_logps = out[0]
            if self.replay == "R3":  # its pi_old routes are the sampler's, replayed here, not recorded
                return
            valid = observed.recorded_positions()  # forward/padding.py may have skipped all-padding columns
            if self.replay == "none":  # metrics only need the completion part
                native, valid = native[:, -logits_to_keep:], valid[:, -logits_to_keep:]
            self.rollout_routes = RouteTable(native.cpu(), valid.cpu())
        else:
            self._record_metrics(native[:, -logits_to_keep:], replay, logits_to_keep)

    def replay_table(self, role, width, logits_to_keep) -> RouteTable | None:
        """Routes to force in this forward: R3's sampler routes in the pi_old pass; R2/R3's `old_routes` in the loss."""
        if self.replay == "none":
            return None
        if role == "old":
            return self._rollout_table(width - logits_to_keep, logits_to_keep) if self.replay == "R3" else None
        ids, valid = self.loss_inputs.get("old_routes"), self.loss_inputs.get("old_routes_valid")
        if ids is None:
            raise RuntimeError(
                f"routing_replay={self.replay!r} but this micro-batch carries no routes (TRL skipped the pi_old "
                "forward they are recorded in?)."
            )
        return RouteTable(ids, valid)

    def _record_metrics(self, current, replay, width):
        """Per micro-batch (device tensors only, no sync): shift, load, replay coverage, R3 sampler mismatch."""
        window = self.diagnostics.window(self.run.mode)
        if window is None:
            return
        inputs = self.loss_inputs
        mask = (
            inputs["completion_mask"] if "tool_mask" not in inputs else inputs["completion_mask"] * inputs["tool_mask"]
        )
        mask = mask.bool()
        window.add_counts(
            "moe/expert_load",
            metrics.expert_load(current, mask, self.hooks.num_experts),
            lambda load: {"moe/expert_load_cv": metrics.expert_load_cv(load)},
        )
        old = inputs.get("old_routes")
        if old is None:
            return
        old = RouteTable(old, inputs["old_routes_valid"]).completion(width).to(current.device)
        counted = mask & old.valid
        shift = metrics.routing_shift_stats(old.ids, current, counted)
        window.add_means(shift)
        if replay is not None:
            window.add_means(metrics.replay_coverage_stats(old.valid, mask))
        if self.replay == "R3" and self.run.training and self.at_sampler_weights:
            window.add_means(
                {
                    "moe/r3/sampler_mismatch": shift["moe/routing_shift"],
                    "moe/r3/sampler_mismatch_any_layer": shift["moe/routing_shift_any_layer"],
                }
            )


# ------------------------------------------------------------------------------------------------- vLLM (R3)
def this_process_routes(raw, prompts, generation, accelerator):
    """The routes of this process's completions among those one of TRL's vLLM generation calls returned (`raw`, in
    TRL's order), or raise when the engine returned none. Server mode: the main process generated for all, so its
    routes are broadcast and each process keeps its slice; tensor parallelism: every rank of a group generated the
    group's prompts."""
    if generation.mode == "server":
        from accelerate.utils import broadcast_object_list

        box = [raw]
        broadcast_object_list(box, from_process=0)
        start = accelerator.process_index * len(prompts)
        raw = None if box[0] is None else box[0][start : start + len(prompts)]
    elif getattr(generation, "tensor_parallel_size", 1) > 1 and raw is not None:
        rank = torch.distributed.get_rank(group=generation.tp_group)
        raw = raw[rank * len(prompts) : (rank + 1) * len(prompts)]
    if raw is None or any(r is None for r in raw):
        raise ValueError(
            "routing_replay='R3' with vLLM: the engine returned no routed_experts. Colocate: trl-gspo builds the "
            "engine with enable_return_routed_experts=True (needs vLLM >= 0.14). Server: start the server with "
            "--enable-return-routed-experts (e.g. `trl vllm-serve --model ... --enable-return-routed-experts`). "
            f"{VLLM_ROUTES_PRECONDITIONS}"
        )
    return raw
