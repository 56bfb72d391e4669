"""Recipe files for the CLI tests: the small `trl-gspo train` recipe on the demo task that test_cli.py and
test_cli_edges.py both run, each test adding or overriding keys."""

from pathlib import Path

import yaml


def write_recipe(path: Path, **keys) -> str:
    path.write_text(yaml.safe_dump(keys))
    return str(path)


def train_recipe(tmp_path: Path, model_dir, data, **extra) -> str:
    """`recipe.yaml` in `tmp_path`: 5 CPU steps of GSPO on `data` with the demo reward, nothing saved, unless
    `extra` says otherwise."""
    keys = dict(
        model_name_or_path=model_dir,
        dataset_name=data,
        reward_funcs=["demo_reward"],
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        learning_rate=1e-3,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        report_to="none",
        save_strategy="no",
        max_steps=5,
    )
    return write_recipe(tmp_path / "recipe.yaml", **{**keys, **extra})
