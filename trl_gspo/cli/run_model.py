"""The model a run loads, decided once per node: the process with local rank 0 on each node resolves a known Hub id
(`common/model_store.resolve_model`, which may ask the Hub and download) and the other processes of that node are told
its answer, so a network blip cannot give two ranks of one node different weights (the Hub's or the prepared GGUF
copy), and a node whose cache is its own (the common cluster layout) loads its own copy rather than a folder that
exists only on another node. Every rank then checks that what it will load is there, before any training.

All ranks exchange what they found in one collective, whatever happened: a resolving rank that fails (a missing copy,
a corrupt provenance file, a permission error, Ctrl-C) sends its one line instead of an answer, and every rank stops
with it at once rather than waiting for `ddp_timeout` in the next collective. What was decided goes into the run's
output folder (`model_source.json`: the Hub id, the source, the Hub revision or the weights' SHA-256)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from pathlib import Path

from ..common import hub_files, model_store
from .recipe_inputs import RecipeError

#: The file in a run's output folder that says which copy of the model it trained.
RECORD = "model_source.json"


def gather_object(objects: list) -> list:
    """Every rank's `objects`, concatenated in rank order, on every rank (accelerate's all-gather of objects)."""
    from accelerate.utils import gather_object as gather

    return gather(objects)


#: Where launchers put a process's rank within its node (srun and mpirun set no LOCAL_RANK of their own).
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def local_rank(args) -> int | None:
    """This process's rank within its node: accelerate's, else the launcher's variable; None where neither says."""
    local = getattr(args, "local_process_index", -1)
    if local is not None and local >= 0:
        return local
    found = [os.environ[name] for name in LOCAL_RANK_VARIABLES if os.environ.get(name, "").isdigit()]
    return int(found[0]) if found else None


def resolves_here(args) -> bool:
    """Whether this process resolves the model for its node: local rank 0 (rank 0 where no local rank is known)."""
    local = local_rank(args)
    return local == 0 if local is not None else args.process_index == 0


def resolved_or_error(name: str, revision: str | None = None) -> model_store.Resolved | str:
    try:
        return model_store.resolve_model(name, revision=revision)
    except model_store.ModelSourceError as err:
        return str(err)


def node(args) -> str:
    """This process as the one-line errors name it: its host (the node) and its rank."""
    return f"{socket.gethostname()}, rank {args.process_index}"


def one_line(text: str) -> str:
    return " ".join(text.split())


def missing(resolved: model_store.Resolved, args) -> str | None:
    """One line where what `resolved` names is not on this node (None where it is): the prepared folder, or the Hub
    cache's snapshot at the resolved revision. Local files only, no network."""
    if resolved.source == "gguf" and not model_store.is_prepared(Path(resolved.path)):
        return (
            f"model {resolved.name}: the prepared copy {resolved.path} is not on this node ({node(args)}), whose "
            f"cache is {model_store.cache_root()}; run `trl-gspo models prepare` on each node, or set TRL_GSPO_CACHE "
            "to a folder every node reads."
        )
    if resolved.revision and hub_files.complete_snapshot(resolved.name, resolved.revision) is None:
        return (
            f"model {resolved.name}: the Hub cache {hub_files.repo_cache(resolved.name)} on this node "
            f"({node(args)}) does not hold revision {resolved.revision} complete; run `trl-gspo models prepare "
            "--source hub` on each node, or set HF_HUB_CACHE to a folder every node reads."
        )
    return None


def checked(resolved: model_store.Resolved, args) -> str | None:
    """`missing`, its own faults (a cache that cannot be read) as one line too: every rank waits for this one's."""
    try:
        return missing(resolved, args)
    except Exception as err:
        return one_line(f"model {resolved.name}: checking {resolved.path} on {node(args)}: {type(err).__name__}: {err}")


def pick(entries: list[tuple[int, str, object]], rank: int, host: str):
    """The answer this rank loads from every rank's (rank, host, answer): that of its node's resolving process (the
    last on its host at or below its rank), else, where its node has none, the first one's (checked by `missing`)."""
    resolvers = [entry for entry in entries if entry[2] is not None]
    if not resolvers:  # every rank sees the same entries, so every rank stops here alike
        raise RecipeError(
            f"no process of this run has local rank 0 to resolve the model ({', '.join(LOCAL_RANK_VARIABLES)}); "
            "launch with accelerate launch, torchrun, srun or mpirun, which set one of them."
        )
    same = [entry for entry in resolvers if entry[1] == host]
    before = [entry for entry in same if entry[0] <= rank]
    return (before[-1] if before else same[0] if same else resolvers[0])[2]


def resolve_for_run(name: str, args, revision: str | None = None) -> model_store.Resolved:
    """`name` (at `revision`) resolved by each node's local rank 0, the answer given to the other ranks of that node,
    and checked present by every rank; any fault anywhere is one line raised on every rank alike."""
    if args.world_size == 1:
        answer = resolved_or_error(name, revision)
        if isinstance(answer, str):
            raise RecipeError(answer)
        problem = missing(answer, args)
        if problem is not None:
            raise RecipeError(problem)
        return answer
    host, failure, answer = socket.gethostname(), None, None
    if resolves_here(args):
        try:
            answer = resolved_or_error(name, revision)
            if isinstance(answer, str):
                answer = f"{answer} ({node(args)})"
        except BaseException as err:  # any fault, Ctrl-C too: the other ranks wait in the exchange until this one joins
            failure = err
            answer = one_line(f"model {name}: resolving it on {node(args)} failed: {type(err).__name__}: {err}")
    entries = gather_object([(args.process_index, host, answer)])
    errors = [entry[2] for entry in entries if isinstance(entry[2], str)]
    if isinstance(failure, KeyboardInterrupt):  # this rank was interrupted: it stops as an interrupted run does
        raise failure
    if errors:
        raise RecipeError(errors[0]) from failure
    mine = pick(entries, args.process_index, host)
    problems = [problem for problem in gather_object([checked(mine, args)]) if problem is not None]
    if problems:
        raise RecipeError(problems[0])
    if sum(entry[2] is not None for entry in entries) > 1 and resolves_here(args):  # each node says its own copy
        mine = dataclasses.replace(mine, note=f"{mine.note} ({node(args)})")
    return mine


def write_record(resolved: model_store.Resolved, output_dir: str) -> None:
    """`model_source.json` in `output_dir` (the main process, when training starts: a run that stops half way still
    says which copy it trained)."""
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    Path(output_dir, RECORD).write_text(json.dumps(resolved.record(), indent=2) + "\n")
