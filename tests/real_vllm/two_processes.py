"""Run by test_server.py under `torch.distributed.run --nproc_per_node 2` (gloo, CPU): GSPO over a real `trl vllm-serve`
process from 2 processes, TRL's layout (the client on the main process only; every process's prompts gathered, sent in
one request, the completions broadcast back). Each rank checks that, at the first rollout, the server's log-probs of
its own rows equal its recomputation at every completion position: they depend on the prompt, so a row whose
completion came back paired with another row's prompt (or another rank's) would not match. Prints one line per rank.

TRL's weight transfer is the test-only no-op of the other server tests (NCCL needs CUDA).
"""

import argparse
import math
import os
import sys


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_dir", required=True)
    parser.add_argument("--url", required=True)
    parser.add_argument("--output_dir", required=True)
    cli = parser.parse_args()

    from trl.generation.vllm_client import VLLMClient

    VLLMClient.init_communicator = lambda self, *a, **k: None
    VLLMClient.update_named_params = lambda self, *a, **k: None

    from real_vllm.conftest import logprob_tolerance, make_trainer
    from real_vllm.test_server import _recomputed

    trainer = make_trainer(
        cli.model_dir, cli.url, cli.output_dir, old_logprobs_source="sampler", per_device_train_batch_size=4
    )
    rank = trainer.accelerator.process_index
    checked, score = {"rows": 0, "gap": None}, trainer._generate_and_score_completions

    def score_and_check(batch):
        output = score(batch)
        if checked["gap"] is None:  # first rollout: the server's weights are the trainer's
            mask = output["completion_mask"].bool()
            recomputed = _recomputed(trainer, output)
            gap = (output["old_per_token_logps"] - recomputed).abs()[mask].max().item()
            seq_len = output["prompt_ids"].size(1) + mask.size(1)
            tolerance = logprob_tolerance(trainer, seq_len, recomputed[mask])
            checked.update(rows=output["completion_ids"].size(0), gap=gap, tolerance=tolerance)
        return output

    trainer._generate_and_score_completions = score_and_check
    trainer.train()
    client = "client" if getattr(trainer.vllm_generation, "vllm_client", None) is not None else "no client"
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    ok = checked["gap"] is not None and checked["gap"] <= checked["tolerance"] and all(map(math.isfinite, losses))
    print(
        f"REAL SERVER rank {rank} {client} rows {checked['rows']} gap {checked['gap']:.3g} steps {len(losses)} "
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
