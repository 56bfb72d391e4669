"""MoE routing replay (trl_gspo/moe/routing.py, moe/route_sources.py, moe/routing_replay.py).

Model level: on a tiny model of each supported architecture, replaying a router's own routes is bit-identical, and a
replayed forward after an optimizer step equals a naive MoE forward written here with the experts forced by hand
(log-probs and router gradients). Trainer level: R2 and R3 end to end, what is replayed where, and every error.
"""

import base64
import io
import math
import types

import numpy as np
import pytest
import torch
from helpers import vllm_stand_in
from helpers.ports import launch_env, two_processes
from helpers.smallest_bug import dropped_token_gap, one_token_gaps
from transformers import AutoModelForCausalLM

from trl_gspo.common import trl_compat
from trl_gspo.moe.route_sources import place_routes, routes_from_engine
from trl_gspo.moe.routing import RouterHooks, RouteTable, route_dtype
from trl_gspo.rounding import model_bound, relative_gap, rounding_bound
from trl_gspo.testing import build_tiny_model, tiny_moe_config

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "gpt_oss"]
VOCAB = 48
B, S = 3, 7


def moe_model(arch, seed=0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(arch, VOCAB), dtype=torch.float32)
    if arch == "gpt_oss":  # its router bias starts at zero; make it matter
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.router.bias.normal_(0, 0.5)
    return model


def token_logps(model, ids):
    """Log-prob of each next token, (B, S-1)."""
    logits = model(input_ids=ids).logits.float()
    return torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def record(hooks, model, ids):
    with torch.no_grad(), hooks.forward_pass(*ids.shape) as observed:
        model(input_ids=ids)
    assert observed.check() is None
    return RouteTable(observed.native_routes().cpu(), torch.ones(ids.shape, dtype=torch.bool))


def shifted(table, num_experts):
    """Other, still distinct, experts for every token and layer."""
    return RouteTable(((table.ids.long() + 1) % num_experts).to(table.ids.dtype), table.valid)


# ------------------------------------------------------------------------------------------------- model level
@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("arch", ARCHS)
def test_replaying_own_routes_is_bit_identical(arch, impl):
    model = moe_model(arch)
    model.set_experts_implementation(impl)
    hooks = RouterHooks.for_model(model)
    ids = torch.randint(3, VOCAB, (B, S))
    with torch.no_grad():
        native = token_logps(model, ids)
        table = record(hooks, model, ids)
        with hooks.forward_pass(B, S, replay=table) as replayed:
            again = token_logps(model, ids)
        with hooks.forward_pass(B, S, replay=shifted(table, hooks.num_experts)):
            forced = token_logps(model, ids)
    assert replayed.check() is None
    assert torch.equal(again, native)
    assert not torch.equal(forced, native)  # the replay is applied (so the equality above is not vacuous)
    assert hooks.active is None  # no replay outside the block


def _naive_block(arch, block, hidden, forced):
    """The MoE block's output with each token's experts forced to `forced` [N, k], computed token by token from the
    module's weights; gate weights from the current router logits by each architecture's published formula."""
    x = hidden.reshape(-1, hidden.size(-1))
    router = block.router if arch == "gpt_oss" else block.gate
    if arch == "deepseek_v3":
        logits = x.float() @ router.weight.float().T
    else:
        logits = x @ router.weight.T + (router.bias if arch == "gpt_oss" else 0)
    picked = []
    for t in range(x.size(0)):
        e = forced[t]
        if arch in ("qwen3_moe", "qwen2_moe", "mixtral"):
            w = torch.softmax(logits[t].float(), -1)[e]
            if arch == "mixtral" or block.gate.norm_topk_prob:
                w = w / w.sum()
        elif arch == "deepseek_v3":
            w = torch.sigmoid(logits[t])[e]
            w = w / (w.sum() + 1e-20) * router.routed_scaling_factor
        else:  # gpt_oss
            w = torch.softmax(logits[t][e], -1)
        out = 0
        for j in range(e.numel()):
            experts = block.experts
            if arch == "gpt_oss":
                gate_up = x[t] @ experts.gate_up_proj[e[j]] + experts.gate_up_proj_bias[e[j]]
                gate, up = gate_up[::2].clamp(max=experts.limit), gate_up[1::2].clamp(-experts.limit, experts.limit)
                y = ((up + 1) * gate * torch.sigmoid(gate * experts.alpha)) @ experts.down_proj[e[j]]
                y = y + experts.down_proj_bias[e[j]]
            else:
                gate, up = (experts.gate_up_proj[e[j]] @ x[t]).chunk(2)
                y = experts.down_proj[e[j]] @ (torch.nn.functional.silu(gate) * up)
            out = out + w[j].to(y.dtype) * y
        picked.append(out)
    routed = torch.stack(picked)
    if arch == "qwen2_moe":
        routed = routed + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    if arch == "deepseek_v3":
        routed = routed + block.shared_experts(x)
    return routed.view_as(hidden)


@pytest.mark.parametrize("arch", ARCHS)
def test_replay_after_an_update_matches_a_naive_forced_forward(arch):
    """Record routes, take an optimizer step (so the router now prefers other experts for some tokens), then replay:
    log-probs and router gradients equal a naive forward with those experts forced by hand."""
    model = moe_model(arch)
    model.set_experts_implementation("eager")
    hooks = RouterHooks.for_model(model)
    ids = torch.randint(3, VOCAB, (B, S))
    old = record(hooks, model, ids)
    (-token_logps(model, ids).mean()).backward()
    # a step that moves some routes, and leaves no token near-certain: a log-prob of ~0 (a step of 5.0 left one at -1e-4)
    # mis-masked to 0 would move by less than the bound, and the companion below could not see it
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 2.0 * p.grad
    model.zero_grad()
    now = record(hooks, model, ids)
    assert not torch.equal(now.ids.sort(-1).values, old.ids.sort(-1).values)  # routing moved: replay must matter

    with hooks.forward_pass(B, S, replay=old):
        replayed = token_logps(model, ids)
    replayed.sum().backward()
    grads = {r.module: r.module.weight.grad.clone() for r in hooks.routers}
    model.zero_grad()

    blocks = [r.module_parent for r in _with_parents(model, hooks)]
    handles = [
        block.register_forward_hook(
            lambda module, args, output, layer=layer: _swap(
                output, _naive_block(arch, module, args[0], old.ids[:, :, layer].reshape(-1, hooks.top_k).long())
            )
        )
        for layer, block in enumerate(blocks)
    ]
    try:
        naive = token_logps(model, ids)
        naive.sum().backward()
    finally:
        for handle in handles:
            handle.remove()
    # fp32 rounding of a forward (trl_gspo/rounding.py), every token; and of its backward for the router gradients
    assert relative_gap(replayed, naive, math.inf) <= model_bound(torch.float32, model.config, S)
    grad_bound = model_bound(torch.float32, model.config, S, B * S)
    for router in hooks.routers:
        assert grads[router.module].abs().sum() > 0
        assert relative_gap(grads[router.module], router.module.weight.grad) <= grad_bound

    def replayed_loss(keep):  # the replayed forward's loss with one more token left out: the router gradients
        model.zero_grad(set_to_none=True)
        with hooks.forward_pass(B, S, replay=old):
            loss = (token_logps(model, ids) * keep).sum()
        loss.backward()
        return loss.detach(), {r.module: r.module.weight.grad.clone() for r in hooks.routers}

    # companions (helpers/smallest_bug.py): one token mis-masked lands outside both bounds
    assert dropped_token_gap(naive, torch.ones_like(naive)) > model_bound(torch.float32, model.config, S)
    assert one_token_gaps(replayed_loss, torch.ones_like(naive))[1] > grad_bound


def _with_parents(model, hooks):
    names = {module: name for name, module in model.named_modules()}
    routers = []
    for router in hooks.routers:
        parent_name = names[router.module].rsplit(".", 1)[0]
        routers.append(types.SimpleNamespace(module=router.module, module_parent=model.get_submodule(parent_name)))
    return routers


def _swap(output, new):
    return (new, *output[1:]) if isinstance(output, tuple) else new


def test_gradient_checkpointing_recomputes_on_the_replayed_routes():
    model = moe_model("qwen3_moe")
    model.train()
    hooks = RouterHooks.for_model(model)
    ids = torch.randint(3, VOCAB, (B, S))
    forced = shifted(record(hooks, model, ids), hooks.num_experts)

    def grads(checkpointing, keep):
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable()
        else:
            model.gradient_checkpointing_disable()
        with hooks.forward_pass(B, S, replay=forced, keep_for_recompute=keep) as observed:
            loss = token_logps(model, ids).sum()
        loss.backward()
        hooks.release()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, observed

    plain, _ = grads(False, keep=True)
    checkpointed, observed = grads(True, keep=True)
    assert observed.recompute_fires == [1] * hooks.num_layers  # each layer was recomputed, on the replayed routes
    assert plain.keys() == checkpointed.keys()
    bound = model_bound(torch.float32, model.config, S, B * S)  # a forward and backward in fp32
    for name in plain:
        assert relative_gap(checkpointed[name], plain[name]) <= bound, name

    def plain_loss(keep):  # the plain forward's loss with one more token left out
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_disable()
        with hooks.forward_pass(B, S, replay=forced, keep_for_recompute=True):
            loss = (token_logps(model, ids) * keep).sum()
        loss.backward()
        hooks.release()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    # companion (helpers/smallest_bug.py): one token mis-masked moves some parameter's gradient past the bound
    assert one_token_gaps(plain_loss, torch.ones(B, S - 1))[1] > bound
    assert all(plain[f"model.layers.{i}.mlp.gate.weight"].abs().sum() > 0 for i in range(hooks.num_layers))
    # what the test guards against: a recompute that routes natively no longer matches its forward (torch notices
    # here because the expert kernel saves a different number of tensors; with other shapes it would not)
    with pytest.raises(torch.utils.checkpoint.CheckpointError):
        grads(True, keep=False)


def test_sentinel_positions_route_natively_and_bad_routes_raise():
    model = moe_model("qwen3_moe")
    hooks = RouterHooks.for_model(model)
    ids = torch.randint(3, VOCAB, (B, S))
    with torch.no_grad():
        native = token_logps(model, ids)
        other = shifted(record(hooks, model, ids), hooks.num_experts)
        valid = torch.ones(B, S, dtype=torch.bool)
        valid[1] = False  # row 1 has no routes at all: it must come out exactly as without replay
        with hooks.forward_pass(B, S, replay=RouteTable(other.ids, valid)):
            mixed = token_logps(model, ids)
    # rounding only (the expert kernels batch other tokens with row 1's: one forward's fp32 rounding), while forced
    # rows move by far more
    assert relative_gap(mixed[1], native[1], math.inf) <= model_bound(torch.float32, model.config, S)
    # companion (helpers/smallest_bug.py): one of row 1's tokens mis-masked lands outside the bound
    assert dropped_token_gap(native[1], torch.ones_like(native[1])) > model_bound(torch.float32, model.config, S)
    assert (mixed[0] - native[0]).abs().max() > 1e-3
    with pytest.raises(
        ValueError,
        match=r"Routes to replay have shape \(3, 6, 2, 2\), but this forward needs "
        r"\(batch, positions, MoE layers, top_k\) = \(3, 7, 2, 2\)",
    ):
        with hooks.forward_pass(B, S, replay=RouteTable(other.ids[:, :6], valid[:, :6])):
            pass
    with pytest.raises(ValueError, match=r"Routes to replay have shape \(3, 7, 1, 2\)"):
        with hooks.forward_pass(B, S, replay=RouteTable(other.ids[:, :, :1], valid)):
            pass


def test_routes_are_stored_compactly():
    assert route_dtype(8) == torch.uint8 and route_dtype(256) == torch.uint8
    assert route_dtype(257) == torch.int16 and route_dtype(32768) == torch.int16
    with pytest.raises(ValueError, match="num_experts=40000"):
        route_dtype(40000)


def test_the_load_balancing_loss_stays_on_the_routers_own_picks():
    """Decision (moe/routing_replay.py): under replay transformers' aux loss sees the router logits, i.e. the router's own
    top-k, not the replayed experts. Checked against the Switch-style formula written here for both choices."""
    model = moe_model("qwen3_moe")
    hooks = RouterHooks.for_model(model)
    ids = torch.randint(3, VOCAB, (B, S))
    forced = shifted(record(hooks, model, ids), hooks.num_experts)
    with torch.no_grad(), hooks.forward_pass(B, S, replay=forced) as observed:
        out = model(input_ids=ids, output_router_logits=True)

    def switch_loss(routes, keep=None):  # routes [B, S, L, k]; pooled over layers: E * sum_e (share of picks) * (mean
        # prob); `keep` [B * S] (0 at a position) leaves a position out of the count
        keep = torch.ones(B * S) if keep is None else keep
        picks, probs = 0, 0
        for layer, logits in enumerate(out.router_logits):
            chosen = torch.nn.functional.one_hot(routes[:, :, layer].reshape(-1, hooks.top_k).long(), hooks.num_experts)
            picks = picks + (chosen.float() * keep[:, None, None]).sum((0, 1))
            probs = probs + (torch.softmax(logits.float(), -1) * keep[:, None]).sum(0)
        rows = len(out.router_logits) * keep.sum()
        return hooks.num_experts * ((picks / rows) * (probs / rows)).sum()

    # the same router logits: fp32 rounding of a softmax over the experts, sums over every position of every layer
    bound = rounding_bound(torch.float32, 2 * hooks.num_experts + len(out.router_logits) * B * S)
    assert relative_gap(out.aux_loss, switch_loss(observed.native_routes())) <= bound
    assert relative_gap(out.aux_loss, switch_loss(forced.ids)) > bound
    # companion (helpers/smallest_bug.py's kind): one position left out of the count lands outside the bound too
    native, dropped = switch_loss(observed.native_routes()), []
    for position in range(B * S):
        keep = torch.ones(B * S)
        keep[position] = 0
        dropped.append(relative_gap(switch_loss(observed.native_routes(), keep), native))
    assert min(dropped) > bound


# --------------------------------------------------------------------------------------------- trainer level
PROMPTS = ["copy 1 2 :", "add 3 4 5 6 =", "copy a :", "count 5 6 7 8 9"]  # different lengths: left padding


def reward(completions, **kwargs):
    return [float(len(c.split()) % 3) for c in completions]


#: The trainers of this file (`trainer_factory`): a tiny Qwen3-MoE unless `model=` says otherwise.
TRAINER = dict(
    reward=reward,
    prompts=PROMPTS * 4,
    moe=True,
    seed=0,
    per_device_train_batch_size=4,
    num_generations=4,
    max_completion_length=6,
    learning_rate=5e-2,
    max_steps=4,
    logging_steps=1,
    disable_tqdm=True,
)


class UsedRoutes:
    """Test-side probe: the experts the routers actually returned in each loss forward (a forward hook registered
    after the trainer's own, so it sees the replayed output), with the micro-batch it ran on."""

    def __init__(self, trainer):
        self.trainer, self.loss_forwards, self._armed = trainer, [], False
        for layer, router in enumerate(trainer.moe_routing.hooks.routers):
            router.module.register_forward_hook(self._hook(layer))
        compute = trainer._compute_loss

        def compute_and_probe(model, inputs):
            self.loss_forwards.append({"inputs": inputs, "used": {}})
            self._armed = True
            try:
                return compute(model, inputs)
            finally:
                self._armed = False

        trainer._compute_loss = compute_and_probe

    def _hook(self, layer):
        def hook(module, args, output):
            if self._armed:
                self.loss_forwards[-1]["used"].setdefault(layer, output[2].detach().clone())

        return hook


@pytest.mark.parametrize("padding", ["padded", "trimmed+sorted"])
def test_r2_replays_recorded_routes_in_the_loss_forward(padding, tokenizer, tmp_path, trainer_factory):
    """Padded (TRL's layout): the routes used at every position of every loss forward are the recorded ones. With
    forward/padding.py's defaults (trimmed, length-sorted): every real token has a recorded route, and all are replayed
    (tests/test_padding.py checks replay through those layouts position by position)."""
    settings = dict(trim_padding=False, sort_by_length="never") if padding == "padded" else {}
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, routing_replay="R2", **settings)
    probe = UsedRoutes(trainer)
    trainer.train()
    assert len(probe.loss_forwards) == 4  # 4 mini-batches of one rollout batch
    for forward in probe.loss_forwards:
        inputs = forward["inputs"]
        old, valid = inputs["old_routes"], inputs["old_routes_valid"]
        assert old.device.type == "cpu" and old.dtype == torch.uint8  # compact, off the accelerator
        real = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1).bool().cpu()
        assert valid[real].all()
        if padding == "padded":
            assert valid.all()
            for layer, used in forward["used"].items():  # routes used == routes recorded, at every position
                assert torch.equal(used, old[:, :, layer].reshape(-1, 2).long())
    rows = [row for row in trainer.state.log_history if "moe/routing_shift" in row]
    assert all(row["moe/replay/coverage"] == 1.0 for row in rows)
    assert rows[0]["moe/routing_shift"] == 0  # on-policy mini-batch
    assert any(row["moe/routing_shift"] > 0 for row in rows[1:])  # the router alone would have moved
    assert trainer.moe_routing.hooks.active is None


def test_r2_changes_nothing_on_policy_and_something_off_policy(tokenizer, tmp_path, trainer_factory):
    def logs(mode):
        trainer = trainer_factory(TRAINER, output_dir=tmp_path / mode, routing_replay=mode)
        trainer.train()
        return [row for row in trainer.state.log_history if "loss" in row]

    plain, replayed = logs("none"), logs("R2")
    assert plain[0]["loss"] == replayed[0]["loss"] and plain[0]["grad_norm"] == replayed[0]["grad_norm"]
    assert any(a["grad_norm"] != b["grad_norm"] for a, b in zip(plain[1:], replayed[1:]))


def test_generate_after_a_replayed_step_routes_natively(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, routing_replay="R2", max_steps=2)
    trainer.train()  # step 2 is off-policy: its loss forward (and backward) ran under replay
    assert trainer.moe_routing.hooks.active is None
    model = trainer.model
    prompt = tokenizer(["copy 1 2 :", "add 3 ="], return_tensors="pt", padding=True, padding_side="left")
    settings = dict(max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    with torch.no_grad():
        hooked = model.generate(**prompt, **settings)
        trainer.moe_routing.hooks.remove()
        bare = model.generate(**prompt, **settings)
    assert torch.equal(hooked, bare)


def test_r3_generate_routes_match_a_reforward_position_by_position(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, routing_replay="R3")
    batch = [{"prompt": p} for p in PROMPTS for _ in range(4)]
    trainer.model.train()
    output = trainer._generate_and_score_completions(batch)
    ids = torch.cat([output["prompt_ids"], output["completion_ids"]], 1)
    mask = torch.cat([output["prompt_mask"], output["completion_mask"]], 1).bool()
    assert output["prompt_mask"].sum(1).unique().numel() > 1  # prompts of different lengths: left padding
    hooks = trainer.moe_routing.hooks
    with torch.no_grad(), hooks.forward_pass(*ids.shape) as observed:
        trainer.model(input_ids=ids, attention_mask=mask.long())
    native, recorded, valid = observed.native_routes(), output["old_routes"], output["old_routes_valid"]
    assert not valid[~mask].any()  # padding has no route
    # every real token has one, except the last completion token when generate() never fed it back
    lengths = output["completion_mask"].sum(1)
    last = output["prompt_ids"].size(1) + lengths - 1
    unfed = lengths == lengths.max()
    expected = mask.clone()
    expected[unfed, last[unfed]] = False
    assert torch.equal(valid, expected)
    assert torch.equal(recorded[valid].long().sort(-1).values, native[valid].long().sort(-1).values)


def test_r3_trains_and_reports_sampler_mismatch(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, routing_replay="R3")
    probe = UsedRoutes(trainer)
    trainer.train()
    forward = probe.loss_forwards[-1]
    old, valid = forward["inputs"]["old_routes"], forward["inputs"]["old_routes_valid"]
    for layer, used in forward["used"].items():
        keep = valid.reshape(-1)
        assert torch.equal(used[keep], old[:, :, layer].reshape(-1, 2)[keep].long())
    rows = [row for row in trainer.state.log_history if "moe/routing_shift" in row]
    assert rows[0]["moe/r3/sampler_mismatch"] == 0  # fp32 generate vs forward on CPU: same experts
    assert 0.5 < rows[0]["moe/replay/coverage"] < 1  # the last sampled token of full-length completions has none
    assert rows[0]["moe/replay/route_mb"] > 0


def test_r3_with_sampler_logprob_reuse(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(
        TRAINER, output_dir=tmp_path, routing_replay="R3", old_logprobs_source="sampler", max_steps=2
    )
    trainer.train()
    rows = [row for row in trainer.state.log_history if "moe/replay/coverage" in row]
    assert len(rows) == 2 and rows[1]["moe/routing_shift"] > 0


def test_replay_fails_loudly_when_a_kernel_bypasses_a_router(tokenizer, tmp_path, trainer_factory):
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, routing_replay="R2", max_steps=2)
    block = trainer.model.model.layers[1].mlp

    def fused(hidden_states):  # a "fused kernel": routes and runs the experts without calling the router module
        flat = hidden_states.view(-1, hidden_states.size(-1))
        logits = flat @ block.gate.weight.T
        weights, experts = torch.softmax(logits, -1).topk(2, dim=-1)
        return block.experts(flat, experts, weights / weights.sum(-1, keepdim=True)).view_as(hidden_states)

    block.forward = fused
    # TRL >= 1.15: forward/padding.py's model calls (one explicit layout each); older TRL: TRL's own row chunks
    bypass = (
        r"routing_replay='R2': (MoE layers \[1\] fired \[0\] times for \d+ model calls|the routers of MoE "
        r"layers \[1\] saw \[0\] tokens for a \d+x\d+ batch) \(a fused MoE kernel"
    )
    with pytest.raises(RuntimeError, match=bypass):
        trainer.train()


def test_replay_errors_name_the_field(tokenizer, tmp_path, trainer_factory):
    with pytest.raises(ValueError, match=r"routing_replay='R2' needs a Mixture-of-Experts model, but 'qwen3' has no"):
        trainer_factory(TRAINER, output_dir=tmp_path, model=build_tiny_model(tokenizer, seed=0), routing_replay="R2")
    from transformers import OlmoeConfig

    olmoe = AutoModelForCausalLM.from_config(
        OlmoeConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=4,
            num_experts_per_tok=2,
            pad_token_id=0,
            eos_token_id=2,
            bos_token_id=None,
        )
    )
    with pytest.raises(
        ValueError,
        match=r"routing_replay='R3': this model's routers \(OlmoeTopKRouter, model_type="
        r"'olmoe'\) are not supported.*Supported: qwen3_moe, qwen2_moe, mixtral, deepseek_v3, gpt_oss",
    ):
        trainer_factory(TRAINER, output_dir=tmp_path, model=olmoe, routing_replay="R3")
    trainer_factory(
        TRAINER, output_dir=tmp_path, model=olmoe, max_steps=1
    ).train()  # metrics only: any MoE router works


# ------------------------------------------------------------------------------------- engine layouts (R3)
LAYERS, K, E = 2, 2, 8


def engine_routes(rows, layers=LAYERS, dtype=np.int32, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([[rng.choice(E, K, replace=False) for _ in range(layers)] for _ in range(rows)]).astype(dtype)


def ingest(raw, p=3, c=4, moe_layers=(0, 1), decoder_layers=2):
    return routes_from_engine(raw, p, c, list(moe_layers), decoder_layers, K, E, where="engine")


def npy_base64(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.parametrize(
    "layout",
    [
        "array_p+c",
        "array_p+c-1",
        "int16",
        "uint8",
        "base64_npy",
        "lists",
        "split_pair",
        "split_dict",
        "decoder_layers",
        "prefix_cache_hits",
    ],
)
def test_each_engine_layout_is_ingested(layout):
    full = engine_routes(7)
    expected = torch.from_numpy(full.astype(np.int64))
    moe_layers, decoder_layers = (0, 1), 2
    if layout == "array_p+c":
        raw = full
    elif layout == "array_p+c-1":
        raw, expected = full[:6], expected.clone()
        expected[6] = -1
    elif layout in ("int16", "uint8"):
        raw = full.astype(layout)
    elif layout == "base64_npy":
        raw = npy_base64(full[:6].astype(np.int16))
        expected = expected.clone()
        expected[6] = -1
    elif layout == "lists":
        raw = full.tolist()
    elif layout == "split_pair":
        raw = (full[:3], full[3:])
    elif layout == "split_dict":
        raw = {"prompt": full[:3], "completion": full[3:]}
    elif layout == "decoder_layers":  # engine numbers layers by decoder layer; layer 0 is dense (DeepSeek-V3 style)
        raw = np.concatenate([np.full((7, 1, K), 0, np.int32), full], axis=1)
        moe_layers, decoder_layers = (1, 2), 3
    else:  # vLLM marks prefix-cache hits with -1
        raw = full.copy()
        raw[:2] = -1
        expected = expected.clone()
        expected[:2] = -1
    got = ingest(raw, moe_layers=moe_layers, decoder_layers=decoder_layers)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "raw, match",
    [
        (engine_routes(5), r"routed_experts has 5 rows for 3 prompt \+ 4 completion tokens \(expected 7 or 6\)"),
        (engine_routes(7, layers=3), r"has 3 layers; expected the 2 MoE layers or all 2 decoder layers"),
        (engine_routes(7)[:, :, :1], r"has top_k=1, the model routes to 2 experts per token"),
        (engine_routes(7) + 8, r"expert id \d+ >= num_experts=8 \(physical ids"),
        (
            np.zeros((7, LAYERS, K), np.int32),
            r"repeats an expert within one token's top-2 \(an engine that returns zeros",
        ),
        (np.zeros((7, LAYERS, K), np.float32), r"must be an integer array \[tokens, layers, top_k\]"),
        ({"prompt": engine_routes(3)}, r"must have keys 'prompt' and 'completion'"),
        ("not-base64!", r"routed_experts is a string but not base64 .npy"),
    ],
)
def test_unknown_engine_layouts_are_rejected(raw, match):
    with pytest.raises(ValueError, match=match):
        ingest(raw)


def test_place_routes_follows_left_padded_prompts_and_right_padded_completions():
    routes = [torch.arange(5 * 2 * 2).view(5, 2, 2) % 8, torch.full((3, 2, 2), 1)]
    routes[1][-1] = -1  # the last sampled token: no route
    table = place_routes(routes, [2, 1], [3, 2], prompt_width=3, completion_width=4, dtype=torch.uint8)
    assert table.ids.shape == (2, 7, 2, 2)
    assert table.valid.tolist() == [
        [False, True, True, True, True, True, False],
        [False, False, True, True, False, False, False],
    ]
    assert torch.equal(table.ids[0, 1:6].long(), routes[0])
    with pytest.raises(
        ValueError, match="completion 0 has 5 routes for 2 prompt \\+ 3 completion tokens in a batch of 1"
    ):
        place_routes(routes, [2, 1], [3, 2], prompt_width=1, completion_width=4, dtype=torch.uint8)


# -------------------------------------------------------------------------------- vLLM stand-in engines (R3)
class StandInVLLM:
    """Mimics TRL's `VLLMGeneration` in colocate mode closely enough for its trainer-side calls: `generate(prompts,
    images, num_generations, profiler)` returning (prompt_ids, completion_ids, logprobs, token_ids), `sync_weights()`,
    and the engine TRL calls underneath (`llm.generate`). Server mode runs TRL's own code: tests/helpers/vllm_stand_in.py."""

    def __init__(self, mode, raw_for):
        self.mode, self.raw_for, self.calls = mode, raw_for, 0
        self.llm = types.SimpleNamespace(generate=self._engine)

    def sync_weights(self):
        pass

    def _completions(self, prompts):
        return [[5 + (i + j) % 10 for j in range(1 + i % 3)] + [2] for i in range(len(prompts))]

    def _engine(self, prompts, **kwargs):
        outputs = []
        for i, (prompt, completion) in enumerate(zip(prompts, self._completions(prompts))):
            ids = prompt["prompt_token_ids"]
            raw = self.raw_for(len(ids), len(completion), i)
            completion_output = types.SimpleNamespace(token_ids=completion, routed_experts=raw)
            outputs.append(types.SimpleNamespace(prompt_token_ids=ids, outputs=[completion_output]))
        return outputs

    def generate(self, prompts, images, num_generations, profiler=None):
        self.calls += 1
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts])
        completions = [o.outputs[0].token_ids for o in outputs]
        return prompts, completions, [[[-1.0]] * len(c) for c in completions], None


@pytest.mark.parametrize(
    "mode, layout", [("colocate", "array_p+c-1"), ("colocate", "split_pair"), ("colocate", "decoder_layers")]
)
def test_vllm_stand_in_routes_reach_the_rollout_batch(tokenizer, tmp_path, mode, layout, trainer_factory):
    made = {}

    def raw_for(p, c, i):
        full = engine_routes(p + c, seed=i)
        made[i] = torch.from_numpy(full.astype(np.int64))
        if layout == "split_pair":
            return (full[:p], full[p:])
        if layout == "decoder_layers":
            return np.concatenate([full[:, :1], full[:, :1], full[:, 1:]], axis=1)  # [0, 0, 1]: unknown layout
        made[i][-1] = -1
        return full[:-1]

    model = build_tiny_model(tokenizer, moe=True, seed=0, num_experts=E)
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, model=model, routing_replay="R3")
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, StandInVLLM(mode, raw_for), -1
    trainer.vllm_importance_sampling_correction = False
    trainer.moe_routing.capture_vllm_routes(trainer.vllm_generation, trainer.accelerator)
    batch = [{"prompt": p} for p in PROMPTS for _ in range(4)]
    trainer.model.train()
    if layout == "decoder_layers":  # 3 layers for a 2-layer model: neither MoE-only nor every decoder layer
        with pytest.raises(ValueError, match=r"vLLM completion 0: routed_experts has 3 layers; expected the 2 MoE"):
            trainer._generate_and_score_completions(batch)
        return
    output = trainer._generate_and_score_completions(batch)
    assert trainer.vllm_generation.calls == 1
    width = output["prompt_ids"].size(1)
    prompt_lens = output["prompt_mask"].sum(1)
    for i in range(len(batch)):
        p = int(prompt_lens[i])
        row = output["old_routes"][i, width - p : width - p + made[i].size(0)].long()
        valid = output["old_routes_valid"][i, width - p : width - p + made[i].size(0)]
        assert torch.equal(valid, (made[i] >= 0).all(-1).all(-1))
        assert torch.equal(row[valid], made[i][valid])


# ------------------------------------------------------------------------- vLLM server mode (R3): TRL's own code
SERVER_ROUTES = trl_compat.vllm_server_returns_routes()
OLD_CLIENT = "this TRL's vLLM client talks to `trl vllm-serve`, which returns no routes (R3 server mode is refused)"


def _server_trainer(tokenizer, tmp_path, trainer_factory):
    model = build_tiny_model(tokenizer, moe=True, seed=0, num_experts=E)
    trainer = trainer_factory(TRAINER, output_dir=tmp_path, model=model, routing_replay="R3")
    hooks = trainer.moe_routing.hooks
    return trainer, vllm_stand_in.StandInServer(len(hooks.routers), hooks.top_k, hooks.num_experts)


def test_vllm_server_routes_reach_the_rollout_batch(tokenizer, tmp_path, trainer_factory):
    """TRL's `VLLMGeneration.generate` (server mode) and `VLLMClient.generate`, one `/v1/completions` request: every
    row's `old_routes` are the server's routes for that row's prompt and completion."""
    trainer, server = _server_trainer(tokenizer, tmp_path, trainer_factory)
    if not SERVER_ROUTES:
        with pytest.raises(ValueError, match=r"vllm_mode='server': this TRL \(.*\) talks to `trl vllm-serve`"):
            vllm_stand_in.server_generation(trainer, server)
        return
    vllm_stand_in.server_generation(trainer, server)
    hooks = trainer.moe_routing.hooks
    checked = vllm_stand_in.check_rollout_routes(trainer, len(hooks.routers), hooks.top_k, hooks.num_experts)
    trainer.model.train()
    trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(4)])
    assert checked["rows"] == 16 and server.requests == [("/v1/completions", 4)]


@pytest.mark.skipif(not SERVER_ROUTES, reason=OLD_CLIENT)
def test_vllm_server_started_without_routes_is_refused_at_set_up(tokenizer, tmp_path, trainer_factory):
    """`trl vllm-serve` serves vLLM's `/server_info`: a server whose `aux_output_config` says it returns no routes is
    refused when the trainer is built, naming the flag, not at the first rollout. Real-engine counterpart:
    tests/real_vllm/test_routes.py."""
    trainer, server = _server_trainer(tokenizer, tmp_path, trainer_factory)
    off = {"aux_output_config": {"enable_return_routed_experts": False, "max_bytes": None}}
    with pytest.raises(ValueError, match=r"server at http://stand-in:8000 was started without --enable-return-routed"):
        vllm_stand_in.server_generation(trainer, server, server_info=off)
    on = {"aux_output_config": {"enable_return_routed_experts": True}}
    vllm_stand_in.server_generation(trainer, server, server_info=on)  # accepted


@pytest.mark.parametrize(
    "info, expected",
    [
        ({"aux_output_config": {"enable_return_routed_experts": True}}, True),
        ({"aux_output_config": {"enable_return_routed_experts": False}}, False),
        ({"model_config": {"enable_return_routed_experts": True}}, True),
        ({"model_config": {}}, None),
        (RuntimeError("no dev endpoints"), None),
    ],
)
def test_server_returns_routes_reads_the_server_info(info, expected):
    from trl_gspo.moe.route_sources import server_returns_routes

    class Client:
        def get_server_info(self):
            if isinstance(info, Exception):
                raise info
            return info

    assert server_returns_routes(Client()) is expected


@pytest.mark.skipif(not SERVER_ROUTES, reason=OLD_CLIENT)
def test_vllm_server_per_prompt_requests_are_put_back_in_prompt_order(tokenizer, tmp_path, trainer_factory):
    """With images TRL sends one request per prompt from a thread pool; the stand-in answers them in reverse order.
    Each completion must still get its own prompt's routes (before: each reply overwrote the last)."""
    trainer, server = _server_trainer(tokenizer, tmp_path, trainer_factory)
    generation = vllm_stand_in.server_generation(trainer, server)
    prompt_ids = [tokenizer(p)["input_ids"] for p in PROMPTS for _ in range(2)]
    _, completions, _, _ = generation.generate(prompt_ids, [["image"]] * len(prompt_ids), num_generations=2)
    assert server.requests == [("/inference/v1/generate", 1)] * len(PROMPTS)
    hooks = trainer.moe_routing.hooks
    assert len(trainer.moe_routing.vllm_routes) == len(prompt_ids)
    for ids, completion, raw in zip(prompt_ids, completions, trainer.moe_routing.vllm_routes, strict=True):
        got = np.load(io.BytesIO(base64.b64decode(raw)))
        assert np.array_equal(
            got, vllm_stand_in.routes_for(ids, completion, len(hooks.routers), hooks.top_k, hooks.num_experts)
        )


@pytest.mark.slow
@pytest.mark.launch  # several processes: one launch at a time (conftest.py)
@pytest.mark.skipif(not SERVER_ROUTES, reason=OLD_CLIENT)
def test_vllm_server_mode_with_two_processes_client_on_the_main_process_only(tmp_path):
    """2 processes (gloo), R3 through the stand-in server for 2 steps: only rank 0 has a client (TRL's layout), both
    ranks train, and every row of each rank's rollout carries the server's routes for its own completion."""
    import os
    import re
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "helpers", "vllm_stand_in.py")
    result = subprocess.run(
        two_processes(script, "--output_dir", tmp_path / "run"),
        capture_output=True,
        text=True,
        env=launch_env(),
        timeout=300,
    )
    log = result.stdout + result.stderr
    ranks = sorted(re.findall(r"R3 SERVER rank (\d) (client|no client) checked (\d+) rows, (\d+) requests", log))
    assert [(rank, client) for rank, client, _, _ in ranks] == [("0", "client"), ("1", "no client")], log[-4000:]
    assert all(int(rows) == 16 for _, _, rows, _ in ranks), ranks  # one rollout of 4 x 4 completions per rank
    assert ranks[0][3] == "1" and ranks[1][3] == "0", ranks  # one request, from the main process
