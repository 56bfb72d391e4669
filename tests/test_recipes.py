"""Every shipped recipe and accelerate config is valid, checked offline with the libraries' own config classes."""

import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trl_gspo.cli.commands import resolve_trainer_class
from trl_gspo.cli.parser import parse
from trl_gspo.cli.rewards import resolve_reward
from trl_gspo.cli.shipped import SHIPPED, resolve_shipped

RECIPES_DIR, ACCELERATE_DIR = SHIPPED["recipe"], SHIPPED["accelerate config"]  # top-level folders; the wheel ships them
RECIPES = sorted(RECIPES_DIR.glob("*.yaml"))
ACCELERATE_CONFIGS = sorted(ACCELERATE_DIR.glob("*.yaml"))


@pytest.fixture
def gpu_recipes_parse_on_cpu(monkeypatch):
    """The real recipes ask for bf16, which TrainingArguments refuses on a machine without a bf16 GPU, and the LoRA
    recipe for bitsandbytes' optimizer, a GPU package; pretend both are present so the rest of the validation (every
    field, GSPOConfig._validate) still runs (the package check itself: tests/test_precision.py)."""
    import transformers.training_args as training_args

    from trl_gspo.common import optimizers

    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.setattr(optimizers, "installed", lambda module: True)


def _command(recipe: Path) -> str:
    """A demo recipe names its task (cli/demo.py, TASKS); every other recipe is `train`'s."""
    import yaml

    return "demo" if "task" in yaml.safe_load(recipe.read_text()) else "train"


def _header(recipe: Path) -> str:
    lines = recipe.read_text().splitlines()
    return "\n".join(line for line in lines[: next(i for i, line in enumerate(lines) if not line.startswith("#"))])


def test_shipped_files_are_the_top_level_folders_and_exist_once_in_git():
    """The design card's layout: `recipes/` and `accelerate_configs/` at the top of the repository are the source of
    truth (the wheel installs them inside the package); no copy of them, generated or not, is tracked anywhere else."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    assert RECIPES_DIR == root / "recipes" and ACCELERATE_DIR == root / "accelerate_configs"
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    shipped = [p for p in tracked if p.startswith(("recipes/", "accelerate_configs/"))]
    assert {Path(p).name for p in shipped} >= {r.name for r in RECIPES} | {c.name for c in ACCELERATE_CONFIGS}
    contents = {(root / p).read_bytes() for p in shipped}
    copies = [p for p in tracked if p not in shipped and (root / p).is_file() and (root / p).read_bytes() in contents]
    assert not copies, f"shipped recipe/config content tracked a second time: {copies}"


def test_expected_recipes_are_shipped():
    names = {r.stem for r in RECIPES}
    assert {
        "demo",
        "smollm2_addition",
        "qwen3_1p7b_math_zero2",
        "qwen3_30b_a3b_moe_zero3",
        "qwen3_4b_lora_24gb",
        "qwen3_1p7b_gspo_token",
        "qwen3_4b_math_vllm",
        "qwen3_30b_a3b_moe_grpo_r2",
        "qwen3_30b_a3b_moe_gspo_r3",
        "qwen3_1p7b_math_dynamic_sampling",
        "qwen3_4b_math_vllm_async",
        "custom_task",
    } <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_parses_into_valid_configs(recipe, gpu_recipes_parse_on_cpu):
    script_args, args, model_args, *_ = parse(_command(recipe), ["--config", str(recipe)])
    if args.importance_sampling_level == "token":  # the paper's GRPO baseline, only with routing replay
        assert (args.epsilon, args.epsilon_high) == (0.2, 0.27) and args.routing_replay == "R2"
    else:
        assert args.importance_sampling_level in ("sequence", "sequence_token")
        assert (args.epsilon, args.epsilon_high) == (3e-4, 4e-4)
    assert args.steps_per_generation == 4 * args.gradient_accumulation_steps, "paper: 4 mini-batches per rollout"
    assert args.beta == 0.0
    if _command(recipe) == "train":
        assert re.fullmatch(r"Qwen/Qwen3-[\w.-]+", model_args.model_name_or_path)
        assert script_args.dataset_name and script_args.reward_funcs
        for name in script_args.reward_funcs:  # a module beside the recipe is importable, as in the CLI
            assert callable(resolve_reward(name, (str(recipe.parent),)))
        assert not args.trust_remote_code
        assert args.bf16 and args.gradient_checkpointing


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_header_says_how_to_run_it(recipe):
    header = _header(recipe)
    for needed in ("Command", "Hardware", "Wall time"):
        assert needed in header, f"{recipe.name}: header lacks {needed!r}"
    assert f"--config {recipe.stem}" in header, f"{recipe.name}: header has no command naming it"
    for config in re.findall(r"--accelerate_config (\S+)", header):  # a stale command would name a missing file
        assert resolve_shipped(config, "accelerate config").is_file(), f"{recipe.name} names {config}"
    assert "accelerate_configs/" not in header and "--config_file" not in header, "use the names, as users do"


def test_moe_recipe_is_the_papers_setting(gpu_recipes_parse_on_cpu):
    _, args, model_args, *_ = parse("train", ["--config", str(RECIPES_DIR / "qwen3_30b_a3b_moe_zero3.yaml")])
    assert model_args.model_name_or_path == "Qwen/Qwen3-30B-A3B"
    assert args.importance_sampling_level == "sequence" and args.loss_type == "grpo"
    assert args.steps_per_generation // args.gradient_accumulation_steps == 4
    header = _header(RECIPES_DIR / "qwen3_30b_a3b_moe_zero3.yaml")
    assert "multi_node.yaml" in header and "zero3" in header


def _fields(recipe: str) -> dict:
    """Every field of every dataclass the recipe parses into, by name."""
    from dataclasses import asdict

    parsed = parse("train", ["--config", str(RECIPES_DIR / f"{recipe}.yaml")])
    return {f"{type(obj).__name__}.{k}": v for obj in parsed for k, v in asdict(obj).items()}


@pytest.mark.parametrize(
    "variant, differs",
    [
        (
            "qwen3_30b_a3b_moe_grpo_r2",
            {"importance_sampling_level": "token", "epsilon": 0.2, "epsilon_high": 0.27, "routing_replay": "R2"},
        ),
        ("qwen3_30b_a3b_moe_gspo_r3", {"routing_replay": "R3"}),
    ],
)
def test_routing_replay_recipes_differ_from_the_moe_recipe_only_where_they_say(
    variant, differs, gpu_recipes_parse_on_cpu
):
    """The variants `extends` the MoE recipe: every parsed field equals the base's except the compared ones and the
    output folder (and what is derived from them: TRL's logging_dir, our correction's default per level)."""
    base, got = _fields("qwen3_30b_a3b_moe_zero3"), _fields(variant)
    changed = {k.split(".", 1)[1] for k in base if base[k] != got[k]}
    # derived: the length-normalised vLLM correction is the default for sequence levels only (rollout/sampler_logprobs.py)
    derived = {"vllm_importance_sampling_length_normalized"} if "importance_sampling_level" in differs else set()
    assert changed - {"output_dir", "logging_dir"} - derived == set(differs)
    for key, value in differs.items():
        assert got[f"GSPOConfig.{key}"] == value
    assert "qwen3_30b_a3b_moe_zero3" in _header(RECIPES_DIR / f"{variant}.yaml")  # the header names what it compares


def test_extends_uses_a_base_next_to_the_recipe_first_and_rejects_cycles(tmp_path, gpu_recipes_parse_on_cpu):
    from trl_gspo.cli.recipe_inputs import RecipeError

    variant = tmp_path / "variant.yaml"
    variant.write_text((RECIPES_DIR / "qwen3_30b_a3b_moe_gspo_r3.yaml").read_text())
    _, args, *_ = parse("train", ["--config", str(variant)])  # no base beside it: the shipped one
    assert args.routing_replay == "R3" and args.steps_per_generation == 16
    base = (RECIPES_DIR / "qwen3_30b_a3b_moe_zero3.yaml").read_text().replace("max_steps: 500", "max_steps: 7")
    (tmp_path / "qwen3_30b_a3b_moe_zero3.yaml").write_text(base)
    _, args, *_ = parse("train", ["--config", str(variant), "--learning_rate", "2e-6"])  # an edited copy beside it
    assert args.max_steps == 7 and args.routing_replay == "R3" and args.learning_rate == 2e-6
    (tmp_path / "a.yaml").write_text("extends: b\nmax_steps: 1\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(RecipeError, match=r"extends: recipes extend each other in a cycle"):
        parse("train", ["--config", str(tmp_path / "a.yaml")])
    (tmp_path / "c.yaml").write_text("extends: no_such_recipe\n")
    with pytest.raises(RecipeError, match=r"no_such_recipe"):
        parse("train", ["--config", str(tmp_path / "c.yaml")])


def test_lora_recipe_builds_a_lora_config_with_8bit_optimizer(gpu_recipes_parse_on_cpu):
    from trl import get_peft_config

    _, args, model_args, *_ = parse("train", ["--config", str(RECIPES_DIR / "qwen3_4b_lora_24gb.yaml")])
    lora = get_peft_config(model_args)
    assert lora is not None and lora.r == 16 and lora.lora_alpha == 32
    assert set(lora.target_modules) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert args.optim.value == "paged_adamw_8bit" and args.bf16 and args.gradient_checkpointing


def test_vllm_recipe_uses_vllm_and_server_mode_flag_overrides(gpu_recipes_parse_on_cpu):
    recipe = str(RECIPES_DIR / "qwen3_4b_math_vllm.yaml")
    _, args, *_ = parse("train", ["--config", recipe])
    assert args.use_vllm and args.vllm_mode == "colocate"
    _, args, *_ = parse("train", ["--config", recipe, "--vllm_mode", "server"])
    assert args.vllm_mode == "server"  # the header's server-mode command


def test_async_vllm_recipe_runs_server_mode_asynchronously(gpu_recipes_parse_on_cpu):
    recipe = RECIPES_DIR / "qwen3_4b_math_vllm_async.yaml"
    _, args, *_ = parse("train", ["--config", str(recipe)])
    assert args.use_vllm and args.vllm_mode == "server" and args.async_generation and args.max_staleness == 1
    assert args.vllm_importance_sampling_correction and args.vllm_importance_sampling_length_normalized
    header = recipe.read_text().split("\nextends:")[0]
    assert (
        "trl vllm-serve --model Qwen/Qwen3-4B" in header
        and "trl-gspo train --config qwen3_4b_math_vllm_async" in header
    )


def test_gspo_token_recipe_trainer_class_overrides_the_documented_hook(gpu_recipes_parse_on_cpu):
    from trl_gspo import GSPOTrainer

    script_args, args, *_ = parse("train", ["--config", str(RECIPES_DIR / "qwen3_1p7b_gspo_token.yaml")])
    assert args.importance_sampling_level == "sequence_token"
    cls = resolve_trainer_class(script_args.trainer_class, (str(RECIPES_DIR),))  # next to the recipe, as the CLI does
    assert issubclass(cls, GSPOTrainer) and cls.token_advantages is not GSPOTrainer.token_advantages


def test_repetition_penalty_token_advantages_on_a_crafted_batch(gpu_recipes_parse_on_cpu):
    RepetitionPenaltyTrainer = resolve_trainer_class(
        "per_token_advantages.RepetitionPenaltyTrainer", (str(RECIPES_DIR),)
    )
    ids = torch.tensor([[5, 6, 5, 6, 5, 0], [1, 2, 3, 4, 1, 2]])
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]])
    fake = SimpleNamespace(ngram=2, penalty=0.5)
    out = RepetitionPenaltyTrainer.token_advantages(
        fake, {"advantages": torch.tensor([1.0, -1.0]), "completion_ids": ids, "completion_mask": mask}
    )
    # Row 0: bigrams (5,6) (6,5) (5,6)* (6,5)*; position 5 is padding. Row 1: (1,2) repeats at the last token.
    expected = torch.tensor([[1, 1, 1, 0.5, 0.5, 1], [-1, -1, -1, -1, -1, -1.5]])
    assert torch.equal(out, expected)  # products of +-1 with 0.5 and 1.5: exact in any float dtype


# ---------------------------------------------------------------------------------------- accelerate configs
def _launch_env(config: Path, monkeypatch):
    """Run accelerate's own launcher logic on the config and export the environment it would give each process."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args, defaults, mp_from_config = _validate_launch_command(
        launch_command_parser().parse_args(["--config_file", str(config), "train.py"])
    )
    if args.use_deepspeed:  # what `accelerate launch` does before choosing the DeepSpeed launcher
        fields = list(defaults.deepspeed_config) + (["mixed_precision"] if mp_from_config else [])
        args.deepspeed_fields_from_accelerate_config = ",".join(fields)
        _, env = prepare_deepspeed_cmd_env(args)
    else:
        env = prepare_multi_gpu_env(args) if args.multi_gpu or args.use_fsdp else {}
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    return args


def test_expected_accelerate_configs_are_shipped():
    assert {p.stem for p in ACCELERATE_CONFIGS} == {
        "single_gpu",
        "multi_gpu",
        "zero2",
        "zero3",
        "zero3_offload",
        "fsdp2",
        "multi_node",
    }


@pytest.mark.parametrize("config", ACCELERATE_CONFIGS, ids=lambda p: p.stem)
def test_accelerate_config_loads_through_accelerates_classes(config, monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin, DistributedType, FullyShardedDataParallelPlugin

    cluster = load_config_from_file(str(config))
    assert cluster.mixed_precision == "bf16" and not cluster.use_cpu
    args = _launch_env(config, monkeypatch)
    expected = {
        "single_gpu": DistributedType.NO,
        "multi_gpu": DistributedType.MULTI_GPU,
        "fsdp2": DistributedType.FSDP,
    }.get(config.stem, DistributedType.DEEPSPEED)
    assert cluster.distributed_type == expected
    if expected == DistributedType.FSDP:
        plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* environment accelerate exported
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward
    if expected == DistributedType.DEEPSPEED:
        plugin = DeepSpeedPlugin()
        stage = {"zero2": 2}.get(config.stem, 3)
        assert plugin.zero_stage == stage
        offload = plugin.deepspeed_config["zero_optimization"].get("offload_param", {}).get("device", "none")
        assert offload == ("cpu" if config.stem == "zero3_offload" else "none")
    if config.stem == "multi_node":
        assert cluster.num_machines == 2 and args.num_processes == 16 and cluster.main_process_port


@pytest.mark.parametrize(
    "config", [c for c in ACCELERATE_CONFIGS if c.stem.startswith(("zero", "multi_node"))], ids=lambda p: p.stem
)
@pytest.mark.parametrize("max_grad_norm", [None, "0.5"], ids=["recipe", "max_grad_norm=0.5"])
def test_deepspeed_section_passes_deepspeeds_own_validation(
    config, max_grad_norm, monkeypatch, gpu_recipes_parse_on_cpu
):
    """accelerate's plugin -> transformers fills the "auto" values from a real recipe -> DeepSpeedConfig checks it.
    Gradient clipping is the recipe's max_grad_norm (a value fixed in the file fails transformers' check otherwise)."""
    pytest.importorskip("deepspeed")
    from accelerate.utils import DeepSpeedPlugin
    from deepspeed.runtime.config import DeepSpeedConfig
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    _launch_env(config, monkeypatch)
    plugin = DeepSpeedPlugin()
    plugin.set_mixed_precision("bf16")
    flags = ["--max_grad_norm", max_grad_norm] if max_grad_norm else []
    _, args, *_ = parse("train", ["--config", str(RECIPES_DIR / "qwen3_30b_a3b_moe_zero3.yaml"), *flags])
    hf_config = HfTrainerDeepSpeedConfig(plugin.deepspeed_config)
    hf_config.trainer_config_process(args)
    assert not hf_config.mismatches, hf_config.mismatches  # what transformers raises on at start-up
    filled = json.loads(json.dumps(hf_config.config))
    assert "auto" not in json.dumps({k: v for k, v in filled.items() if k != "zero_optimization"})
    ds = DeepSpeedConfig(filled)  # world size 1 here: no process group
    assert ds.zero_optimization_stage == plugin.zero_stage
    assert ds.train_micro_batch_size_per_gpu == args.per_device_train_batch_size
    assert ds.gradient_accumulation_steps == args.gradient_accumulation_steps
    assert ds.bfloat16_config.enabled and ds.gradient_clipping == args.max_grad_norm == float(max_grad_norm or 1.0)
    assert os.environ["ACCELERATE_USE_DEEPSPEED"] == "true"


def test_dynamic_sampling_recipe_differs_from_the_math_recipe_only_in_its_fields(gpu_recipes_parse_on_cpu):
    base, got = _fields("qwen3_1p7b_math_zero2"), _fields("qwen3_1p7b_math_dynamic_sampling")
    changed = {k.split(".", 1)[1] for k in base if base[k] != got[k]}
    assert changed - {"output_dir", "logging_dir"} == {"dynamic_sampling"}  # the other three keys spell out defaults
    assert got["GSPOConfig.dynamic_sampling"] is True and got["GSPOConfig.max_sampling_rounds"] == 4
    assert got["GSPOConfig.max_steps"] > 0  # a fixed number of steps, not epochs (docs/dynamic-sampling.md)
    assert "qwen3_1p7b_math_zero2" in _header(RECIPES_DIR / "qwen3_1p7b_math_dynamic_sampling.yaml")
