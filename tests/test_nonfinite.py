"""Non-finite guard: NaN/inf micro-batches contribute nothing, bad optimizer steps are skipped and counted, a run that
keeps failing stops with a checkpoint; zero-advantage groups and empty completions give finite losses."""

import math

import pytest
import torch
from helpers.fault_utils import make_trainer
from transformers import TrainerCallback

from trl_gspo import GSPOTrainer
from trl_gspo.guards import checkpointing
from trl_gspo.guards.nonfinite import NonFiniteTrainingError


class NaNLogpsTrainer(GSPOTrainer):
    """Poisons log-probs on the micro-steps listed in `nan_steps` (counted from 0): the current policy's (in the
    autograd graph, like an overflow in the forward pass) or, with `poison_old`, the old policy's (bad input)."""

    nan_steps = ()
    poison_old = False

    def _get_per_token_logps_and_entropies(self, *args, **kwargs):
        logps, entropies, aux = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if self.model.training and torch.is_grad_enabled() and self._step in self.nan_steps and not self.poison_old:
            logps = logps * torch.tensor(float("nan"))
        return logps, entropies, aux

    def _compute_loss(self, model, inputs):
        if self._step in self.nan_steps and self.poison_old:
            inputs = {**inputs, "old_per_token_logps": inputs["old_per_token_logps"].clone()}
            inputs["old_per_token_logps"][0, 0] = float("nan")
        return super()._compute_loss(model, inputs)


class WeightRecorder(TrainerCallback):
    def __init__(self):
        self.weights = []

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights.append({k: v.detach().clone() for k, v in model.state_dict().items()})


def _train(tmp_path, nan_steps=(), poison_old=False, **overrides):
    NaNLogpsTrainer.nan_steps, NaNLogpsTrainer.poison_old = nan_steps, poison_old
    trainer = make_trainer(tmp_path, trainer_cls=NaNLogpsTrainer, **overrides)
    recorder = WeightRecorder()
    trainer.add_callback(recorder)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "nonfinite/microbatches" in h]
    return trainer, recorder.weights, logs


def _all_finite(weights):
    return all(torch.isfinite(v).all() for v in weights.values())


def _same(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


def test_nan_microbatch_skips_step_and_is_counted(tmp_path):
    trainer, weights, logs = _train(tmp_path, nan_steps=(1,), max_steps=4)
    assert [h["nonfinite/microbatches"] for h in logs] == [0.0, 1.0, 0.0, 0.0]
    assert [h["nonfinite/skipped_steps"] for h in logs] == [0.0, 1.0, 0.0, 0.0]
    assert all(_all_finite(w) for w in weights)
    assert _same(weights[0], weights[1])  # step 2 was skipped: no update at all (no Adam moment, no decay)
    assert not _same(weights[1], weights[2])  # training goes on afterwards
    adam_steps = {int(s["step"]) for s in trainer.optimizer.state.values()}
    assert adam_steps == {3}
    assert math.isfinite(logs[1]["loss"])


def test_one_bad_microbatch_of_two_drops_only_its_gradient(tmp_path):
    """2 micro-batches per optimizer step, a NaN old log-prob in one: that one is dropped, the step still updates
    with the other's gradient, which is exactly the gradient of the good micro-batch alone."""
    kwargs = dict(max_steps=2, gradient_accumulation_steps=2, steps_per_generation=4, max_grad_norm=0.0)
    trainer, weights, logs = _train(tmp_path / "a", nan_steps=(2,), poison_old=True, **kwargs)
    assert [h["nonfinite/microbatches"] for h in logs] == [0.0, 1.0]
    assert [h["nonfinite/skipped_steps"] for h in logs] == [0.0, 0.0]
    assert _all_finite(weights[1]) and not _same(weights[0], weights[1])

    class DropThird(NaNLogpsTrainer):  # reference: the same run where micro-batch 2 simply has zero loss
        def _compute_loss(self, model, inputs):
            loss = super()._compute_loss(model, inputs)
            return loss * 0.0 if self._step == 2 else loss

    NaNLogpsTrainer.nan_steps = ()
    ref = make_trainer(tmp_path / "b", trainer_cls=DropThird, **kwargs)
    ref.train()
    for name, value in ref.model.state_dict().items():
        torch.testing.assert_close(weights[1][name], value, rtol=0, atol=0)


def test_nan_in_forward_of_one_microbatch_skips_whole_step(tmp_path):
    """A NaN produced by the model's forward poisons the backward of that micro-batch beyond the loss: the
    accumulated gradient is non-finite, so the whole optimizer step is skipped (and both events are counted)."""
    kwargs = dict(max_steps=2, gradient_accumulation_steps=2, steps_per_generation=4)
    trainer, weights, logs = _train(tmp_path, nan_steps=(2,), **kwargs)
    assert [h["nonfinite/microbatches"] for h in logs] == [0.0, 1.0]
    assert [h["nonfinite/skipped_steps"] for h in logs] == [0.0, 1.0]
    assert _same(weights[0], weights[1]) and _all_finite(weights[1])


def test_nonfinite_gradient_with_finite_loss_skips_step(tmp_path):
    """A NaN that only shows up in the backward (here injected into one parameter's gradient) is caught at the
    optimizer step."""
    NaNLogpsTrainer.nan_steps, NaNLogpsTrainer.poison_old = (), False
    trainer = make_trainer(tmp_path, trainer_cls=NaNLogpsTrainer, max_steps=3)
    recorder = WeightRecorder()
    trainer.add_callback(recorder)
    param = next(trainer.model.parameters())
    # _step counts finished micro-steps, so 1 is the second step's backward
    param.register_hook(lambda g: g * float("nan") if trainer._step == 1 else g)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "nonfinite/microbatches" in h]
    assert [h["nonfinite/microbatches"] for h in logs] == [0.0, 0.0, 0.0]
    assert [h["nonfinite/skipped_steps"] for h in logs] == [0.0, 1.0, 0.0]
    assert _same(recorder.weights[0], recorder.weights[1]) and all(_all_finite(w) for w in recorder.weights)


def test_consecutive_nonfinite_steps_stop_with_checkpoint(tmp_path):
    NaNLogpsTrainer.nan_steps, NaNLogpsTrainer.poison_old = range(1, 100), False
    trainer = make_trainer(tmp_path, trainer_cls=NaNLogpsTrainer, max_steps=8, max_consecutive_nonfinite=3)
    initial_step1 = None

    class Keep(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            nonlocal initial_step1
            if state.global_step == 1:
                initial_step1 = {k: v.detach().clone() for k, v in model.state_dict().items()}

    trainer.add_callback(Keep())
    with pytest.raises(
        NonFiniteTrainingError,
        match=r"3 consecutive optimizer steps .*max_consecutive_nonfinite=3.*"
        r"3 micro-batches dropped and 3 optimizer steps skipped.*checkpoint-4",
    ):
        trainer.train()
    ckpt = tmp_path / "checkpoint-4"
    assert checkpointing.checkpoint_problem(str(ckpt)) is None
    from safetensors.torch import load_file

    saved = load_file(ckpt / "model.safetensors")
    for name, value in saved.items():  # the last good weights: those after step 1, never touched by a NaN
        torch.testing.assert_close(value, initial_step1[name], rtol=0, atol=0)


def test_log_ratio_clamp_keeps_far_off_policy_batch_finite(tmp_path):
    """old log-probs 1e4 below the current ones: log s ~ 1e4. The clamp (max_log_ratio=20) keeps the ratio finite;
    without it exp overflows to inf and the guard drops the micro-batch instead."""
    batch = _batch(old_shift=-1e4)
    clamped = make_trainer(tmp_path / "a")
    loss, grads = _loss_and_grads(clamped, batch)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert clamped.nonfinite._dropped.item() == 0

    unclamped = make_trainer(tmp_path / "b", max_log_ratio=None)
    loss, grads = _loss_and_grads(unclamped, batch)
    assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads.values())
    assert unclamped.nonfinite._dropped.item() == 1


def _batch(old_shift=0.02, advantages=None, lengths=(6, 1, 0, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    B, P, T = len(lengths), 4, 6
    completion_mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {
        "prompt_ids": torch.randint(4, 40, (B, P), generator=g),
        "prompt_mask": torch.ones(B, P, dtype=torch.long),
        "completion_ids": torch.randint(4, 40, (B, T), generator=g),
        "completion_mask": completion_mask,
        "advantages": torch.tensor([1.0, -0.5, 0.7, -1.2]) if advantages is None else advantages,
        "old_shift": old_shift,
        "num_items_in_batch": completion_mask.sum(),
    }


def _loss_and_grads(trainer, batch):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = 1
    inputs = {k: v for k, v in batch.items() if k != "old_shift"}
    with torch.no_grad():  # old log-probs near (or far from) the current ones
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model,
            torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1),
            inputs["completion_ids"].size(1),
        )
    inputs["old_per_token_logps"] = logps + batch["old_shift"]
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("level", ["sequence", "sequence_token", "token"])
def test_zero_advantage_and_empty_completions_finite(tmp_path, level):
    """Every reward equal (advantages 0) and completions of length 0, even a batch of only empty completions."""
    trainer = make_trainer(tmp_path, importance_sampling_level=level)
    for batch in (_batch(advantages=torch.zeros(4)), _batch(lengths=(0, 0, 0, 0)), _batch(lengths=(0, 6, 0, 2))):
        loss, grads = _loss_and_grads(trainer, batch)
        assert torch.isfinite(loss), batch["completion_mask"]
        assert all(torch.isfinite(g).all() for g in grads.values())
        if batch["advantages"].abs().sum() == 0 or batch["completion_mask"].sum() == 0:
            assert loss.item() == 0.0 and all(torch.count_nonzero(g) == 0 for g in grads.values())
    assert trainer.nonfinite._dropped.item() == 0


def test_all_equal_rewards_train_finitely(tmp_path):
    trainer = make_trainer(tmp_path, reward_funcs=lambda completions, **kw: [1.0] * len(completions), max_steps=2)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and "nonfinite/microbatches" in h]
    assert all(h["loss"] == 0.0 and h["grad_norm"] == 0.0 and h["nonfinite/microbatches"] == 0 for h in logs)
    assert logs[0]["frac_reward_zero_std"] == 1.0


# ------------------------------------------------------------------- SAPO, VESPO and evaluation, guarded too
def test_sapo_keeps_the_log_ratio_clamp_where_stock_trl_gives_nan_gradients(tmp_path):
    """SAPO runs through the rebuilt loss: with old log-probs 1e4 below the current ones, stock TRL's exp overflows
    and its gradient is NaN (sigmoid'(inf) * inf); ours is clamped at max_log_ratio and stays finite."""
    from trl import GRPOConfig, GRPOTrainer

    batch = _batch(old_shift=-1e4)
    ours = make_trainer(tmp_path / "a", loss_type="sapo", importance_sampling_level="token")
    loss, grads = _loss_and_grads(ours, batch)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
    assert ours.nonfinite._dropped.item() == 0

    tokenizer_model = make_trainer(tmp_path / "c")  # same tiny model and tokenizer, in a stock trainer
    args = GRPOConfig(
        output_dir=str(tmp_path / "b"),
        use_cpu=True,
        bf16=False,
        report_to=[],
        loss_type="sapo",
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=6,
    )
    stock = GRPOTrainer(
        tokenizer_model.model,
        tokenizer_model.reward_funcs,
        args=args,
        train_dataset=tokenizer_model.train_dataset,
        processing_class=tokenizer_model.processing_class,
    )
    _, stock_grads = _loss_and_grads(stock, batch)
    assert any(not torch.isfinite(g).all() for g in stock_grads.values()), "stock TRL stayed finite: test is moot"


def test_vespo_loss_is_guarded_on_its_own_loss(tmp_path):
    """VESPO runs TRL's own loss code: a NaN in the current log-probs makes its loss NaN; the guard drops it."""
    trainer = make_trainer(tmp_path, trainer_cls=NaNLogpsTrainer, loss_type="vespo", importance_sampling_level="token")
    NaNLogpsTrainer.nan_steps, NaNLogpsTrainer.poison_old = (trainer._step,), False
    try:
        loss, _ = _loss_and_grads(trainer, _batch())
    finally:
        NaNLogpsTrainer.nan_steps = ()
    assert loss.item() == 0.0 and trainer.nonfinite._dropped.item() == 1


def test_evaluation_losses_are_guarded_and_counted(tmp_path):
    """A non-finite evaluation micro-batch adds 0 to eval_loss and shows in eval_nonfinite/microbatches."""
    trainer = make_trainer(tmp_path, per_device_eval_batch_size=4, eval_strategy="no")
    good, bad = _batch(), _batch(old_shift=float("nan"))
    trainer.model.eval()
    with torch.no_grad():
        for batch, expect_dropped in ((good, 0.0), (bad, 1.0)):
            inputs = {k: v for k, v in batch.items() if k != "old_shift"}
            inputs["old_per_token_logps"] = torch.full(inputs["completion_ids"].shape, batch["old_shift"])
            loss = trainer._compute_loss(trainer.model, inputs)
            assert torch.isfinite(loss)
            assert trainer._metrics["eval"]["nonfinite/microbatches"][-1] == expect_dropped
    assert loss.item() == 0.0
    assert trainer.nonfinite._seen == 0, "evaluation must not count toward the training step's micro-batches"
