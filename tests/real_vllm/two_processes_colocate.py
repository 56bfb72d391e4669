"""Run by test_colocate.py under `torch.distributed.run --nproc_per_node 2` (gloo, CPU): GSPO with vLLM colocate from
2 processes, each with its own engine (TRL's layout: vLLM's `external_launcher`, one engine per rank with
tensor_parallel_size=1). After every weight sync, each rank checks that its engine's log-probs of one fixed sequence
equal its trainer's (test_colocate.py's check, per rank). Prints one line per rank.
"""

import argparse
import math
import os
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from real_vllm.conftest import colocated_engine_dtype, logprob_tolerance, make_trainer

    colocated_engine_dtype("float32")  # as in test_colocate.py
    from real_vllm.test_colocate import MOVED_AT_LEAST, SEQUENCE, _engine_logps, _trainer_logps

    trainer = make_trainer(
        cli.model_dir,
        None,
        cli.output_dir,
        vllm_mode="colocate",
        vllm_server_base_url=None,
        steps_per_generation=1,
        max_steps=3,
        per_device_train_batch_size=4,
        vllm_max_model_length=128,
    )
    rank = trainer.accelerator.process_index
    generation = trainer.vllm_generation
    sync, syncs = generation.sync_weights, []

    def recorded_sync():
        before = _engine_logps(generation.llm)
        sync()
        after, own = _engine_logps(generation.llm), _trainer_logps(trainer)
        syncs.append(
            (
                trainer.state.global_step,
                (after - own).abs().max().item() / logprob_tolerance(trainer, len(SEQUENCE), own),
                (after - before).abs().max().item(),
            )
        )

    generation.sync_weights = recorded_sync
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    ok = (
        [step for step, *_ in syncs] == [0, 1, 2]
        and all(map(math.isfinite, losses))
        and all(gap <= 1 and (step == 0 or moved > MOVED_AT_LEAST) for step, gap, moved in syncs)
    )
    gaps = max(gap for _, gap, _ in syncs) if syncs else float("nan")  # as a fraction of the rounding tolerance
    print(
        f"REAL COLOCATE rank {rank} syncs {len(syncs)} gap/tolerance {gaps:.3g} steps {len(losses)} "
        f"{'OK' if ok else 'BAD'}",
        flush=True,
    )
    sys.stderr.flush()
    os._exit(
        0
    )  # skip interpreter teardown, where a finished CPU rank sometimes aborts (see tests/helpers/cpu_launch.py)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/, for real_vllm.*
    main()
