"""The one seam on TRL (issue: every TRL override in trainer.py, features as parts with explicit interfaces).

- `GSPOTrainer` subclasses `GRPOTrainer` alone; every TRL / transformers method it overrides is defined in
  `trainer.py`, marked with the part it serves and saying why; no other class of the package defines a method of
  TRL's trainer (a mixin would).
- docs/design.md's seam table is the one these tests build from the code: the overrides (the trainer's methods
  against TRL's) and the runtime patches (`common/seam.PATCHES`). `python tests/test_seam.py` prints it.
- A part calls only its own methods on `self` (another part is a collaborator it was given), and reaches nothing of
  the trainer that trl-gspo added (its parts) through the trainer it may hold for TRL's state.
- Outside common/seam.py, nothing assigns an attribute of an object other than `self` (a TRL or vLLM object, or
  another part's state), but for the plain-data objects listed in `ASSIGNMENTS_ALLOWED`, each with its reason.

Each checker is also run on a planted violation, which it must report.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import pkgutil
import re
import sys
import textwrap
from pathlib import Path

from trl import GRPOTrainer

import trl_gspo
from trl_gspo import GSPOTrainer
from trl_gspo.common import seam, trl_compat
from trl_gspo.config import FEATURE_OPTIONS

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "trl_gspo"
DESIGN = ROOT / "docs" / "design.md"
TABLE_START, TABLE_END = "<!-- seam table: built from the code by tests/test_seam.py -->", "<!-- end of seam table -->"

#: Attribute assignments on objects other than `self` the package makes outside common/seam.py: (module, the target as
#: written) -> why it is not a patch of a TRL or vLLM object nor another part's state.
ASSIGNMENTS_ALLOWED = {
    ("cli/commands.py", "args.model_init_kwargs"): "the CLI's own parsed arguments",
    ("cli/commands.py", "model_args.model_name_or_path"): "the CLI's own parsed arguments (a known Hub id resolved)",
    ("cli/commands.py", "model_args.model_revision"): "the CLI's own parsed arguments (the Hub snapshot resolved)",
    ("cli/demo.py", "args.model_init_kwargs"): "the demo's own config (the Hub snapshot resolved)",
    ("common/model_prepare.py", "config._name_or_path"): "the converted model's own config, named by its Hub id",
    ("common/model_prepare.py", "model.config._name_or_path"): "the converted model's own config, named by its Hub id",
    ("common/model_prepare.py", "model.generation_config"): "the converted model's own: the GGUF model's settings",
    ("cli/demo.py", "tokenizer.padding_side"): "the demo's own tokenizer",
    ("cli/demo.py", "model.config._name_or_path"): "the demo's own model, named after the folder it is saved in",
    ("cli/demo.py", "model.name_or_path"): "the demo's own model, named after the folder it is saved in (for vLLM)",
    ("cli/parser.py", "parser.recipe_name"): "the CLI's own parser",
    ("cli/parity.py", "trainer.current_gradient_accumulation_steps"): "a parity case's trainer, driven by hand",
    ("cli/parser.py", "parser.recipe_dir"): "the CLI's own parser",
    ("cli/recipe_inputs.py", "model_args.model_name_or_path"): "the CLI's own parsed arguments",
    ("cli/recipe_inputs.py", "entry.path"): "the CLI's own parsed recipe",
    ("cli/recipe_inputs.py", "entry.data_files"): "the CLI's own parsed recipe",
    ("cli/recipe_inputs.py", "setattr"): "the CLI's own parsed arguments (paths resolved next to the recipe)",
    ("cli/rewards.py", "math_accuracy_reward.needs_one_of"): "the package's own reward function",
    ("testing.py", "tok.pre_tokenizer"): "a tokenizer built here",
    ("testing.py", "tok.post_processor"): "a tokenizer built here",
    ("testing.py", "tokenizer.chat_template"): "a tokenizer built here",
    ("testing.py", "config.pad_token_id"): "a model config built here",
    ("testing.py", "config.eos_token_id"): "a model config built here",
    ("testing.py", "setattr"): "a model config built here",
    ("forward/pipeline.py", "support.problem"): "the forward's own record of a model (SegmentSupport)",
    ("forward/segment_attention.py", "segment_plan.calls"): "the forward's own SegmentPlan",
    ("forward/segment_attention.py", "config._attn_implementation"): "transformers' documented switch between "
    "registered attention functions (AttentionInterface), armed for the step's segment calls and put back",
    ("guards/checkpointing.py", "control.should_save"): "transformers' TrainerControl: what a callback returns",
    ("guards/checkpointing.py", "control.should_training_stop"): "transformers' TrainerControl",
    ("guards/nonfinite.py", "control.should_save"): "transformers' TrainerControl",
    ("guards/nonfinite.py", "control.should_training_stop"): "transformers' TrainerControl",
    ("guards/nonfinite.py", "p.grad"): "torch's gradient, set to None to skip the optimizer step",
    ("guards/precision.py", "param.data"): "torch's parameter data: trainable bf16 weights upcast to fp32 before the "
    "optimizer exists, and cast for the final save and put back",
    ("common/engine.py", "accelerator.gradient_accumulation_steps"): "accelerate's documented setter, given the "
    "run's accumulation (DeepSpeed's) before `prepare`, which takes the same value itself after warning",
    ("rollout/dynamic_sampling.py", "control.should_training_stop"): "transformers' TrainerControl",
    ("guards/rewards_guard.py", "guarded.__gspo_guarded__"): "the package's own wrapper of a reward function",
    ("guards/rewards_guard.py", "guarded_async.__gspo_guarded__"): "the package's own wrapper of a reward function",
    ("moe/routing.py", "current.closed"): "the router hooks' own RouterPass",
    ("rollout/vllm_setup.py", "facts.cuda"): "the set-up check's own record (VLLMFacts)",
    ("rollout/vllm_setup.py", "facts.push_replaced"): "the set-up check's own record (VLLMFacts)",
    ("rollout/vllm_setup.py", "facts.model_path"): "the set-up check's own record (VLLMFacts)",
    ("rollout/vllm_setup.py", "facts.cpu_build"): "the set-up check's own record (VLLMFacts)",
    ("rollout/vllm_setup.py", "facts.head_dim"): "the set-up check's own record (VLLMFacts)",
    ("rollout/vllm_setup.py", "facts.head_dim_supported"): "the set-up check's own record (VLLMFacts)",
    ("rollout/async_backends.py", "future.busy_s"): "the generator thread's own Future",
    ("rollout/async_backends.py", "greedy.do_sample"): "a copy of the generation config, made for the generator",
    ("rollout/async_backends.py", "greedy.temperature"): "a copy of the generation config",
    ("rollout/async_backends.py", "greedy.top_k"): "a copy of the generation config",
    ("rollout/async_backends.py", "greedy.top_p"): "a copy of the generation config",
    ("rollout/async_backends.py", "greedy.min_p"): "a copy of the generation config",
    ("rollout/async_backends.py", "sub.gradient_checkpointing"): "the generator's own copy of the policy",
    ("rollout/async_server.py", "response.status_code"): "a requests Response built to answer TRL's client",
    ("rollout/async_server.py", "response._content"): "a requests Response built to answer TRL's client",
    ("rollout/async_server.py", "response.encoding"): "a requests Response built to answer TRL's client",
    ("rollout/async_server.py", "response.url"): "a requests Response built to answer TRL's client",
    ("rollout/async_rollouts.py", "completions.sampled_at"): "the source's own Completions",
    ("rollout/async_rollouts.py", "job.result"): "the source's own job record",
    ("rollout/async_rollouts.py", "filler.cursor"): "the source's own DynamicSampling (its prompt cursor)",
    ("forward/segment_attention.py", "ctx.layout"): "torch's context of the part's own autograd Function (_BlockKeys)",
    ("rollout/colocate_cpu_sync.py", "module.quant_method.moe_kernel"): "vLLM's expert kernel, dropped inside the "
    "layer-wise reload the registered `sync_weights_inside` patch runs, so the reload repacks the experts",
}


# ------------------------------------------------------------------------------------------------ the table
def seam_rows() -> list[tuple[str, str, str, str]]:
    """(what, TRL releases checked, part, why no public seam) for every override and runtime patch."""
    checked = ", ".join(trl_compat.CHECKED_TRL_RELEASES)
    rows = [
        (f"`GRPOTrainer.{e.name}` (override)", checked, e.part or "", e.why)
        for e in seam.overrides(GSPOTrainer, GRPOTrainer).values()
    ]
    rows += [(f"`{e.name}` (patch: `seam.{name}`)", e.checked, e.part, e.why) for name, e in seam.PATCHES.items()]
    return rows


def render_table() -> str:
    lines = [
        "| overridden method or patched object | TRL checked on | part | why no public seam |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {what} | {checked} | {part} | {why} |" for what, checked, part, why in seam_rows()]
    return "\n".join(lines)


def documented_table() -> str:
    text = DESIGN.read_text()
    if TABLE_START not in text or TABLE_END not in text:
        return ""
    return text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()


def test_gspo_trainer_subclasses_grpo_trainer_alone():
    assert GSPOTrainer.__bases__ == (GRPOTrainer,)


def test_every_override_is_marked_with_its_part_and_why():
    found = seam.overrides(GSPOTrainer, GRPOTrainer)
    assert "_compute_loss" in found and "_get_per_token_logps_and_entropies" in found
    for name, entry in found.items():
        method = inspect.unwrap(vars(GSPOTrainer)[name])
        assert inspect.getsourcefile(method) == str(PACKAGE / "trainer.py"), name
        assert entry.part, f"{name} overrides TRL without @override(part)"
        assert len(entry.why.split()) >= 5, f"{name}'s docstring does not say why it overrides TRL"


def test_design_doc_table_is_the_codes():
    expected = render_table()
    assert documented_table() == expected, (
        f"docs/design.md's seam table (between {TABLE_START!r} and {TABLE_END!r}) differs from the code; it "
        f"should read (python tests/test_seam.py prints it):\n{expected}"
    )


def test_the_table_check_notices_an_undocumented_override(monkeypatch):
    @seam.override("planted")
    def evaluate(self, *args, **kwargs):
        """A planted override, documented nowhere."""

    monkeypatch.setattr(GSPOTrainer, "evaluate", evaluate, raising=False)
    assert "`GRPOTrainer.evaluate` (override)" in render_table()
    assert documented_table() != render_table()


def test_the_table_check_notices_an_undocumented_patch(monkeypatch):
    monkeypatch.setitem(seam.PATCHES, "planted", seam.SeamEntry("trl.Planted", "nowhere", "planted", "1.16.0"))
    assert documented_table() != render_table()


def test_every_override_runs_on_this_trl(tmp_path, monkeypatch):
    """Train with evaluation and a checkpoint, resume from it, save: every override is called at least once, so
    `.ci/run`'s pass over each TRL release (this file among the parity tests) checks each of them there."""
    from datasets import Dataset
    from helpers.fault_utils import make_trainer

    calls = {name: 0 for name in seam.overrides(GSPOTrainer, GRPOTrainer)}
    for name in calls:
        original = vars(GSPOTrainer)[name]

        def counted(self, *args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(GSPOTrainer, name, counted)
    evaluation = dict(eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    settings = dict(max_steps=2, save_strategy="steps", save_steps=2, **evaluation)
    settings["eval_dataset"] = Dataset.from_dict({"prompt": ["add 1 2 ="] * 4})
    make_trainer(tmp_path, **settings).train()
    resumed = make_trainer(tmp_path, **{**settings, "max_steps": 3})
    resumed.train(resume_from_checkpoint=True)
    resumed.save_model(str(tmp_path / "final"))
    assert [name for name, count in calls.items() if count == 0] == []


# --------------------------------------------------------------------------------- overrides outside trainer.py
def package_modules() -> list:
    names = [trl_gspo.__name__] + [m.name for m in pkgutil.walk_packages(trl_gspo.__path__, "trl_gspo.")]
    return [importlib.import_module(name) for name in names]


def trainer_methods() -> set[str]:
    return {
        name
        for klass in GRPOTrainer.__mro__
        if klass is not object
        for name, value in vars(klass).items()
        if callable(value) and not name.startswith("__")
    }


def foreign_overrides(modules) -> list[str]:
    """Classes other than GSPOTrainer defining a method of TRL's trainer (module.Class.method)."""
    methods, found = trainer_methods(), []
    for module in modules:
        for name, cls in vars(module).items():
            if not inspect.isclass(cls) or cls.__module__ != module.__name__ or cls is GSPOTrainer:
                continue
            found += [f"{module.__name__}.{name}.{m}" for m in sorted(set(vars(cls)) & methods)]
    return found


def test_no_class_but_the_trainer_overrides_a_trainer_method():
    assert foreign_overrides(package_modules()) == []


def test_the_override_check_finds_a_planted_mixin(tmp_path, monkeypatch):
    (tmp_path / "planted_mixin.py").write_text(
        "class RolloutMixin:\n    def _prepare_inputs(self, batch):\n        return batch\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("planted_mixin")
    try:
        assert foreign_overrides([module]) == ["planted_mixin.RolloutMixin._prepare_inputs"]
    finally:
        sys.modules.pop("planted_mixin", None)


# -------------------------------------------------------------------------------------------- parts' calls
def _class_nodes(tree):
    return [node for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def _self_attributes_assigned(cls_node) -> set[str]:
    names = set()
    for node in ast.walk(cls_node):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                    names.add(t.attr)
    return names


@functools.cache  # read once: it parses TRL's trainer classes' source, seconds of CPU, and is asked for by module
def trainer_additions() -> frozenset[str]:
    """What GSPOTrainer holds that TRL's trainer does not: its own methods and the attributes it assigns (its parts)."""
    trl_names = {name for klass in GRPOTrainer.__mro__ for name in vars(klass)}
    trl_source = "".join(inspect.getsource(klass) for klass in GRPOTrainer.__mro__ if klass.__module__ != "builtins")
    trl_names |= set(re.findall(r"self\.(\w+)\s*=", trl_source))
    tree = ast.parse((PACKAGE / "trainer.py").read_text())
    trainer_node = next(node for node in _class_nodes(tree) if node.name == "GSPOTrainer")
    return frozenset((set(vars(GSPOTrainer)) | _self_attributes_assigned(trainer_node)) - trl_names)


def _declared_fields(cls) -> set[str]:
    """Names a class declares with an annotation (dataclass fields), anywhere in its MRO, and the attributes the
    `__init__` of a base from another library assigns (TRL's sampler, transformers' callbacks, argparse)."""
    names = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in ("trl_gspo", "builtins"):
            try:
                names |= set(re.findall(r"self\.(\w+)\s*(?::[^=]*)?=", inspect.getsource(klass)))
            except (OSError, TypeError):
                pass
    return names


def cross_part_calls(source: str, module) -> list[str]:
    """In each class of `source` (module `module` loaded), a `self.name(...)` call to a name the class neither has
    nor assigns (a method expected on `self` from elsewhere: a mixin), and `trainer.<name>` / `self.trainer.<name>`
    where `<name>` is something GSPOTrainer added to TRL's trainer (a part reached through the trainer)."""
    ours = trainer_additions()
    found = []
    for cls_node in _class_nodes(ast.parse(source)):
        cls = getattr(module, cls_node.name, None)
        if cls is None or cls is GSPOTrainer or cls in FEATURE_OPTIONS:  # options: fields of one config, validated
            continue
        assigned, fields = _self_attributes_assigned(cls_node), _declared_fields(cls)
        for node in ast.walk(cls_node):
            if not isinstance(node, ast.Attribute):
                continue
            value = node.value
            if isinstance(value, ast.Name) and value.id == "self" and isinstance(getattr(node, "ctx", None), ast.Load):
                if node.attr not in assigned and not hasattr(cls, node.attr) and node.attr not in fields:
                    found.append(f"{cls_node.name}: self.{node.attr}")
            trainer = (isinstance(value, ast.Name) and value.id == "trainer") or (
                isinstance(value, ast.Attribute) and value.attr == "trainer"
            )
            if trainer and node.attr in ours:
                found.append(f"{cls_node.name}: {ast.unparse(node)}")
    return found


def test_parts_call_only_their_own_methods_and_no_part_through_the_trainer():
    found = []
    for module in package_modules():
        path = Path(module.__file__)
        if path == PACKAGE / "trainer.py":
            continue
        found += [f"{path.relative_to(ROOT)}: {f}" for f in cross_part_calls(path.read_text(), module)]
    assert found == []


def test_the_call_check_finds_a_planted_cross_part_call(tmp_path, monkeypatch):
    source = textwrap.dedent(
        """
        class Padding:
            def __init__(self, trainer):
                self.trainer = trainer

            def arrange(self, batch):
                if self._segment_support(batch):  # expects the forward's method on self, as a mixin would
                    return self.trainer.logprob_forward.loss_cost(batch)  # another part, through the trainer
                return self.own(batch)

            def own(self, batch):
                return batch
        """
    )
    (tmp_path / "planted_part.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("planted_part")
    try:
        assert cross_part_calls(source, module) == [
            "Padding: self._segment_support",
            "Padding: self.trainer.logprob_forward",
        ]
    finally:
        sys.modules.pop("planted_part", None)


# -------------------------------------------------------------------------------------------- runtime patches
def foreign_assignments(path: Path, source: str) -> list[str]:
    """`X.attr = ...` (or `setattr(X, ...)`) with `X` not `self` / `cls`, not allowed by `ASSIGNMENTS_ALLOWED`."""
    where = str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else path.name
    if where == "common/seam.py":
        return []
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if (where, "setattr") not in ASSIGNMENTS_ALLOWED:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
            continue
        targets = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if not isinstance(t, ast.Attribute):
                    continue
                if isinstance(t.value, ast.Name) and t.value.id in ("self", "cls"):
                    continue
                if (where, ast.unparse(t)) not in ASSIGNMENTS_ALLOWED:
                    found.append(f"{where}:{node.lineno}: {ast.unparse(t)} = ...")
    return found


def test_nothing_outside_the_seam_module_patches_another_object():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += foreign_assignments(path, path.read_text())
    assert found == [], "patch TRL or vLLM in common/seam.py (registered), or call a method of the other part"


def test_every_allowed_assignment_still_exists():
    """An allowance whose assignment is gone is dead weight (and would hide a new one of the same name)."""
    present = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        text = path.read_text()
        present |= {(w, target) for w, target in ASSIGNMENTS_ALLOWED if w == where and target in text}
    assert set(ASSIGNMENTS_ALLOWED) - present == set()


def test_the_patch_check_finds_a_planted_patch(tmp_path):
    source = textwrap.dedent(
        """
        from trl.trainer import utils

        def faster(trainer):
            utils._CHUNKED_LOGPROB_CHUNK_SIZE = 1024
            trainer.vllm_generation.sync_weights = lambda: None
            self_like = trainer.rollout
            self_like.injected = None
        """
    )
    assert foreign_assignments(tmp_path / "planted.py", source) == [
        "planted.py:5: utils._CHUNKED_LOGPROB_CHUNK_SIZE = ...",
        "planted.py:6: trainer.vllm_generation.sync_weights = ...",
        "planted.py:8: self_like.injected = ...",
    ]


def test_every_patch_is_a_function_of_the_seam_module():
    for name in seam.PATCHES:
        assert inspect.getsourcefile(inspect.unwrap(getattr(seam, name))) == str(PACKAGE / "common" / "seam.py"), name


def test_no_loss_type_branching_outside_the_loss_registry_and_the_config():
    pattern = re.compile(r"loss_type\s*(==|!=|\bin\b|\bnot in\b)|\bin\s*\([^)]*\"(grpo|dapo|bnpo|cispo|sapo)\"")
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).as_posix() in ("losses.py", "config.py"):
            continue
        lines = enumerate(path.read_text().splitlines(), 1)
        found += [f"{path.relative_to(ROOT)}:{i}" for i, line in lines if pattern.search(line)]
    assert found == []


if __name__ == "__main__":  # the table docs/design.md holds between its markers
    print(render_table())
