"""The supported TRL releases, and every TRL-internal difference between them (and the few differences of the
transformers `Trainer` underneath that our code touches), in one place.

`GSPOTrainer` subclasses `trl.GRPOTrainer` and overrides some of its private methods, all in `trainer.py`
(common/seam.py registers them, with the runtime patches). Private names can change in any TRL release, so the range
below is what the test matrix ran (README, "Install"; `.ci/run` checks every release of `CHECKED_TRL_RELEASES`), and
the code outside this module never asks which TRL it runs on: it calls the helpers here. `RunView` (end of the module)
is what the parts read of the running trainer.

Why TRL 1.10.0 is the floor: `GRPOTrainer._compute_loss` is the same code from 1.10.0 to 1.16.0 (a comment differs),
and that is the code our loss rebuild reproduces. 1.9.x aggregates `loss_type="luspo"` as
`per_token_loss * |y_i|` and divides the entropy bonus of `dapo`/`cispo`/`vespo` by the global token count; 1.8 and
older log their metrics differently again. Those semantics are not ours, so they are refused at import rather than
trained with a silently different loss.

Private TRL names the package relies on (`GRPOTrainer` methods and attributes unless a module is named), and how they
differ from 1.10.0 to 1.16.0 (last row: transformers across its supported range):

| name | used by | difference across the range |
| --- | --- | --- |
| `_compute_loss(model, inputs)` | trainer.py (owned) | none (the loss the parity tests compare against) |
| `_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False, compute_aux_loss=False, <multimodal>)` | trainer (overridden: the forward pipeline), forward (TRL's own padded loop, called with keywords from `batch_size` on) | same `(logps, entropies, aux_loss)` return; 1.14 takes `model, *args` and everything from `batch_size` on as keywords (a positional `batch_size` raised "got multiple values"); inside: full logits up to 1.13, full logits or a Liger-only chunked path in 1.14, TRL's fused chunked LM head from 1.15 |
| `trl.trainer.utils._CHUNKED_LOGPROB_CHUNK_SIZE` | fused_head, via `fused_logprob_head_module` here | from 1.15 (32768, the fused head's tile); absent before, where no fused head exists |
| `_generate_single_turn(prompt_ids, images, multimodal_fields, [num_generations,] has_tool_images=False)` | rollout (for sampler_logprobs, routing_replay) | `num_generations` added in 1.14.2; the override passes `*args, **kwargs` through |
| `_generate(prompts)` | rollout (for sampler_logprobs, routing_replay) | none: 8-tuple, per-token sampler log-probs at index 4 |
| `_generate_and_score_completions(inputs)` | rollout (for sampler_logprobs, routing_replay) | none in the keys read here (`old_per_token_logps`, `sampling_per_token_logps`, `importance_sampling_ratio`) |
| `_calculate_rewards(...)`, `get_high_entropy_mask`, `get_off_policy_mask` | rewards_guard, trainer, rollout, dynamic_sampling (rewards of a sampling round, gathered over processes) | none |
| `_pending_extra_logs` (completion-table columns from `log_extra`, flushed by `_generate_and_score_completions`), `reward_weights`, `reward_func_names`, `environment_factories` | dynamic_sampling | none |
| `trl.trainer.utils.nanstd` | dynamic_sampling (TRL's group std, for the filter and `frac_reward_zero_std`) | none |
| `_prepare_inputs` (owned), `_step`, `_buffered_inputs` | rollout, checkpointing | none (rollout buffer split into `steps_per_generation` mini-batches, regenerated every `steps_per_generation * num_iterations` micro-steps) |
| `trl.trainer.utils.shuffle_sequence_dict`, `split_tensor_dict`, `split_pixel_values_by_grid`, `unsplit_pixel_values_by_grid` | rollout (TRL's shuffle and split of a rollout batch) | none |
| model call `model(..., labels=, fused_lm_head=True)` returning `.log_probs`, `.entropy`, `.aux_loss` (TRL's `add_fused_lm_head`) | forward (trimmed / sorted / packed / shared forwards) | from 1.15; before, padding removal and prompt sharing are off (logged) and `padding_free=True` / `shared_prefix=True` are refused |
| transformers: `AttentionInterface.register`, `AttentionMaskInterface.register`, `config._attn_implementation`, extra model kwargs reaching the attention function | segment_attention (packed and shared-prefix calls) | public extension points of transformers 5.x; same from 5.17 to 5.23 |
| `_metrics`, `_entropy_bonus_enabled`, `_last_world_entropy`, `_entropy_window_stats`, `aux_loss_enabled`, `router_aux_loss_coef` | trainer, `RunView` here (for the parts) | none; `GRPOConfig.router_aux_loss_coef` defaults to 0.001 up to 1.13 and to the model config's value from 1.14 (the trainer attribute TRL resolved is read) |
| `trl.trainer.utils.is_async_callable` | rewards_guard, via `is_async_callable` here | from 1.14; before, TRL decides with `inspect.iscoroutinefunction` |
| old-policy log-prob pass condition | sampler_logprobs, routing_replay, config (R2 check), via `old_logprob_pass_needed` / `old_logprob_pass_runs` here | none |
| `transformers.Trainer.end()` (TRL's base class) | cli, via `end_training` here | transformers >= 5.19 only |
| `_generate(prompts)` index 5 (`extra_fields`), `rollout_func`, `tools` | routing_replay (R3 routes from a `rollout_func`) | none |
| `vllm_generation.generate`, `.mode`, `.llm.generate` (colocate), `.tp_group`, `trl.generation.vllm_generation.LLM` | routing_replay (R3 routes from vLLM; the patches are common/seam.py's) | none |
| `vllm_generation.vllm_client` (main process only), its `generate(prompts=..., features=...)` and `_post(url, json=...)` (server) | routing_replay, via `vllm_server_returns_routes` here and common/seam.py's `on_server_responses` | 1.14.2 and 1.16: posts to vLLM's own `/v1/completions` (routes in each choice), and 1.16 with images one `/inference/v1/generate` request per prompt from a thread pool; 1.10: `trl vllm-serve`'s `/generate/`, no routes |
| `trl.trainer.utils.RepeatSampler` (`data_source`, `mini_repeat_count`, `batch_size`, `repeat_count`, `shuffle`, `seed`, `generator`, `num_samples`), `GRPOTrainer._get_train_sampler` | checkpointing (`EpochRepeatSampler`) | none: one seeded `torch.Generator`, one `randperm` per pass over the data |
| `_generate_single_turn` arguments, `_tokenize_prompts` (through it), `rollout_func`, `generation_config`, `eos_token_ids`, `pad_to_multiple_of`, `_tokenizer` | rollout, async_rollouts (generation ahead of time), via `single_turn_request` and `eos_token_ids` here | `num_generations` from 1.14.2; `eos_token_ids` (several end tokens) in 1.16, the tokenizer's `eos_token_id` in 1.10 |
| `vllm_generation.vllm_client.base_url`, `.model` (the served name, read from `/v1/models`), `.session.post`, `.get_server_info()` (vLLM's `/server_info`) | served_model (the server serves the trainer's model), routing_replay (the server returns routes) | 1.14.2 and 1.16 read `.model`; `get_server_info` in 1.16; where either is missing the check is skipped (logged for the served model) |
| `vllm_generation.sync_weights`, `_last_loaded_step`, `VLLMGeneration.generate`'s sampling parameters, `vllm_client.session.post` (server) | async_rollouts (server requests sent from the generator thread, weights pushed at sync points), via `vllm_server_sampling_params` here | checked at run time: the request TRL makes must equal the one sent ahead of time |
| `vllm_generation.sync_weights` (replaced on the instance), `.llm.llm_engine.model_executor.driver_worker.model_runner` (colocate; its `.model`, `.model_config`, the path TRL's own sync loads through) | colocate_cpu_sync (vLLM's CPU build: the sync inside vLLM's layer-wise reload) | none in TRL; vLLM 0.31 and 0.32 tested, a vLLM without `model_loader.reload` is refused at set-up |

A new TRL-internal use (an override of another private method, a hook on TRL's old-policy pass) belongs in this
table, and a difference across the range gets a helper here, not a version check at the call site.
"""

from __future__ import annotations

import inspect
import warnings
from importlib import metadata

#: Oldest TRL whose `GRPOTrainer._compute_loss` our rebuild reproduces (see the module docstring).
MIN_TRL = "1.10.0"
#: Newest TRL minor release the test matrix covers (any 1.16.x).
NEWEST_TESTED_TRL = "1.16"
SUPPORTED_TRL = f">={MIN_TRL},<1.17"
#: The releases `.ci/run` checks (`trl-gspo check` and the parity tests), the newest patch of each minor release the
#: range admits: every override and patch of common/seam.py was checked on them.
CHECKED_TRL_RELEASES = ("1.10.0", "1.11.0", "1.12.0", "1.13.0", "1.14.2", "1.16.0")


class UnsupportedTRLVersionError(ImportError):
    """The installed TRL is older than the oldest release whose loss semantics this package reproduces."""


def installed_trl_version() -> str:
    """The installed TRL's version string, read from package metadata (TRL is not imported)."""
    return metadata.version("trl")


def check_trl_version(version: str | None = None) -> str:
    """Refuse a TRL older than `MIN_TRL`; warn on one newer than the tested range. Returns the version checked.

    Older releases compute a different loss, so training would silently differ from what this package documents:
    that is an error. A newer release may be fine: the warning points at `trl-gspo check`, which compares our loss
    and gradients with the installed stock `GRPOTrainer` in under a minute.
    """
    from packaging.version import Version

    version = installed_trl_version() if version is None else version
    how = 'See the installed versions with `pip show trl` (or `python -c "import trl; print(trl.__version__)"`).'
    if Version(version) < Version(MIN_TRL):
        raise UnsupportedTRLVersionError(
            f"trl-gspo supports TRL {SUPPORTED_TRL} (tested {MIN_TRL} to {NEWEST_TESTED_TRL}.x); the installed TRL is {version}, whose "
            f"GRPOTrainer computes a different loss. Upgrade it: pip install 'trl{SUPPORTED_TRL}'. {how}"
        )
    if Version(version).release[:2] > Version(NEWEST_TESTED_TRL).release[:2]:  # 1.17.0.dev0 counts as 1.17
        warnings.warn(
            f"TRL {version} is newer than the releases trl-gspo was tested with ({SUPPORTED_TRL}). GSPOTrainer rebuilds "
            "one private TRL method, so run `trl-gspo check` once: it compares our loss and gradients with this TRL's "
            f"GRPOTrainer and exits non-zero naming what changed. Or install a tested TRL: pip install 'trl{SUPPORTED_TRL}'.",
            UserWarning,
            stacklevel=3,
        )
    return version


def is_async_callable(func) -> bool:
    """Whether the installed TRL awaits `func` as a reward function (its own rule, so a wrapper agrees with TRL)."""
    try:
        from trl.trainer.utils import is_async_callable as trl_rule  # TRL >= 1.14: also async `__call__` objects
    except ImportError:
        return inspect.iscoroutinefunction(func)  # what TRL < 1.14 checks
    return trl_rule(func)


def fused_logprob_head_module():
    """The TRL module whose `_CHUNKED_LOGPROB_CHUNK_SIZE` sets the vocabulary tile of TRL's fused, chunked log-prob
    head (TRL >= 1.15), or None where TRL has no such head and materialises the completion logits (<= 1.14)."""
    from trl.trainer import utils as trl_utils

    return trl_utils if hasattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE") else None


def end_training(trainer) -> None:
    """Finish the trackers and destroy the process group at the end of a CLI run, as `trl grpo` does: transformers
    >= 5.19 has `Trainer.end()` for that; older releases have no such method and leave both to interpreter exit."""
    end = getattr(trainer, "end", None)
    if end is not None:
        end()


def sampling_path(trainer) -> str:
    """What generates a training batch's completions in TRL's `_generate`: its `rollout_func` ("rollout_func"), vLLM
    ("vllm"), transformers continuous batching ("continuous_batching") or transformers `generate` ("generate")."""
    if getattr(trainer, "rollout_func", None) is not None:
        return "rollout_func"
    if trainer.use_vllm:
        return "vllm"
    return "continuous_batching" if trainer.use_transformers_continuous_batching else "generate"


def old_logprob_pass_runs(
    steps_per_generation: int, num_iterations: int, gradient_accumulation_steps: int, vllm_correction: bool
) -> bool:
    """TRL's condition for its no-grad pi_old forward in `_generate_and_score_completions` (same 1.10 to 1.16): the
    rollout batch is used for more than one optimizer step, or vLLM's importance-sampling correction needs pi_old."""
    return gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0 or vllm_correction


def old_logprob_pass_needed(trainer) -> bool:
    """`old_logprob_pass_runs` for a built trainer (its vLLM correction may have been switched off at construction)."""
    return old_logprob_pass_runs(
        trainer.args.steps_per_generation,
        trainer.num_iterations,
        trainer.args.gradient_accumulation_steps,
        bool(trainer.use_vllm and trainer.vllm_importance_sampling_correction),
    )


def vllm_server_returns_routes() -> bool:
    """Whether TRL's vLLM client (server mode) talks to vLLM's own OpenAI server, whose responses carry
    `routed_experts` per choice: 1.14.2 and 1.16 post there through `VLLMClient._post`; 1.10 talks to `trl
    vllm-serve`'s `/generate/`, which returns no routes. Read from the class, so every process answers the same (TRL
    creates the client instance on the main process only)."""
    try:
        from trl.generation.vllm_client import VLLMClient
    except ImportError:
        return False
    return hasattr(VLLMClient, "_post")


def single_turn_request(trainer, args: tuple, kwargs: dict) -> tuple:
    """`(images, multimodal_fields, num_generations)` of a `_generate_single_turn(prompt_ids, images, multimodal_fields,
    [num_generations,] has_tool_images=False)` call: `num_generations` is an argument from 1.14.2; before, TRL used the
    trainer's (training mode)."""
    images = args[0] if args else kwargs.get("images")
    fields = args[1] if len(args) > 1 else kwargs.get("multimodal_fields")
    n = kwargs.get("num_generations")
    if n is None and len(args) > 2 and isinstance(args[2], int) and not isinstance(args[2], bool):
        n = args[2]
    return images, fields or {}, trainer.num_generations if n is None else n


def vllm_server_sampling_params(generation, num_generations: int) -> dict:
    """The keyword arguments TRL's `VLLMGeneration.generate` passes to `VLLMClient.generate` in server mode (1.16),
    for sending the same request ahead of time (rollout/async_rollouts.py). If they ever differ from what TRL then sends, the
    source notices (it compares the request bodies) and raises, so a drift here cannot go unseen."""
    min_p = getattr(generation, "min_p", 0.0)
    return {
        "n": num_generations,
        "repetition_penalty": generation.repetition_penalty,
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "top_k": generation.top_k,
        "min_p": 0.0 if min_p is None else min_p,
        "max_tokens": generation.max_completion_length,
        "logprobs": getattr(generation, "logprobs", 0),
        "structured_outputs_regex": getattr(generation, "structured_outputs_regex", None),
        "generation_kwargs": getattr(generation, "generation_kwargs", None),
    }


def eos_token_ids(trainer) -> list[int]:
    """The token ids that end a completion in TRL's transformers generation: `eos_token_ids` from 1.14 (a model may
    declare several), the tokenizer's one `eos_token_id` before."""
    ids = getattr(trainer, "eos_token_ids", None)
    return list(ids) if ids else [trainer._tokenizer.eos_token_id]


class RunView:
    """What the parts read of the running trainer that changes while it runs: its mode, its optimizer step, the
    policy module (accelerate and DeepSpeed may replace it), and TRL's metric lists. Everything fixed a part needs it
    gets at construction."""

    def __init__(self, trainer):
        self._trainer = trainer

    @property
    def model(self):
        return self._trainer.model

    @property
    def training(self) -> bool:
        return self._trainer.model.training

    @property
    def mode(self) -> str:
        return "train" if self.training else "eval"

    @property
    def global_step(self) -> int:
        return self._trainer.state.global_step

    @property
    def sampling_path(self) -> str:
        """What generates: "rollout_func", "vllm", "continuous_batching" or "generate" (trl_compat.sampling_path)."""
        return sampling_path(self._trainer)

    @property
    def old_pass_runs(self) -> bool:
        """TRL runs its no-grad pi_old forward when scoring a rollout batch (trl_compat.old_logprob_pass_needed)."""
        return old_logprob_pass_needed(self._trainer)

    @property
    def vllm_correction(self) -> bool:
        """TRL corrects for the vLLM sampler (`vllm_importance_sampling_correction`, with vLLM)."""
        return bool(self._trainer.use_vllm and self._trainer.vllm_importance_sampling_correction)

    def log_metric(self, name: str, value: float, mode: str | None = None) -> None:
        """Append `value` to TRL's metric `name` (averaged over the logging window by TRL's `log`)."""
        self._trainer._metrics[mode or self.mode][name].append(value)
