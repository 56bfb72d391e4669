"""A stand-in vLLM server for R3 in server mode: TRL's own `VLLMGeneration` and `VLLMClient` code runs, only the HTTP
server is replaced (also run as a 2-process script by tests/test_routing_replay.py).

As in TRL, the client exists on the main process only (TRL creates it in `VLLMGeneration._init_vllm`, replaced here by
the stand-in's), prompts of every process are gathered, the main process posts them and broadcasts the completions.
`StandInServer.post` answers the two requests TRL's client makes: `/v1/completions` (one request for every prompt, n
choices each, prompt-major) and `/inference/v1/generate` (one request per prompt, sent from TRL's thread pool when
prompts carry images; answered in reverse order here, so replies arrive out of order). Each choice carries
`routed_experts` as vLLM's OpenAI server sends them (base64 `.npy`, one row per token but the last), computed from the
prompt and completion ids alone, so any process can recompute what the server sent for its own rows.

Why a stand-in: vLLM's CPU build refuses to return routed experts (`--enable-return-routed-experts` needs Model Runner
V2, which needs Triton; pinned in tests/real_vllm/test_routes.py), so R3 with vLLM's routes can run for real only on a
CUDA build (`make gpu-check`). Everything else of server mode runs against the real engine in tests/real_vllm/.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import sys
import threading
import time
import zlib

import numpy as np

EOS = 2  # trl_gspo.testing's tokenizer


def completion_for(prompt_ids, j: int) -> list[int]:
    """The server's j-th completion of a prompt: 1-3 word tokens, then EOS."""
    h = zlib.crc32(bytes(str(list(prompt_ids)), "ascii")) + j
    return [5 + (h + k) % 10 for k in range(1 + h % 3)] + [EOS]


def routes_for(prompt_ids, completion_ids, layers: int, top_k: int, num_experts: int) -> np.ndarray:
    """Routes the server returns for one choice: [prompt + completion - 1, layers, top_k] distinct experts per row."""
    rng = np.random.default_rng(zlib.crc32(bytes(str([list(prompt_ids), list(completion_ids)]), "ascii")))
    rows = len(prompt_ids) + len(completion_ids) - 1
    return np.stack([[rng.choice(num_experts, top_k, replace=False) for _ in range(layers)] for _ in range(rows)])


def npy_base64(array) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array.astype(np.int16))
    return base64.b64encode(buffer.getvalue()).decode()


class StandInServer:
    def __init__(self, layers: int, top_k: int, num_experts: int):
        self.layers, self.top_k, self.num_experts = layers, top_k, num_experts
        self.requests = []  # (path, number of prompts), in arrival order
        self._lock = threading.Lock()

    def _choice(self, prompt_ids, j):
        completion = completion_for(prompt_ids, j)
        return {
            "prompt_token_ids": list(prompt_ids),
            "token_ids": completion,
            "logprobs": {
                "tokens": [f"token_id:{t}" for t in completion],
                "token_logprobs": [-1.0] * len(completion),
                "top_logprobs": [None] * len(completion),
            },
            "routed_experts": npy_base64(routes_for(prompt_ids, completion, self.layers, self.top_k, self.num_experts)),
        }

    def post(self, url, json=None, **kwargs):
        if url.endswith("/v1/completions"):  # one request for every prompt; choices prompt-major
            self.requests.append(("/v1/completions", len(json["prompt"])))
            return {"choices": [self._choice(p, j) for p in json["prompt"] for j in range(json["n"])]}
        if url.endswith("/inference/v1/generate"):  # one prompt per request, from TRL's thread pool
            ids, n = json["token_ids"], json["sampling_params"]["n"]
            with self._lock:
                arrived = len(self.requests)
                self.requests.append(("/inference/v1/generate", 1))
            time.sleep(0.05 * max(0, 6 - arrived))  # the first requests answer last: replies arrive in reverse order
            return {"choices": [self._choice(ids, j) for j in range(n)]}
        raise AssertionError(f"stand-in server: unexpected request {url}")


def server_generation(trainer, server, server_info=None):
    """TRL's `VLLMGeneration` in server mode on `trainer`, its client (TRL's `VLLMClient`, talking to `server`) on the
    main process only, as TRL builds it; then the R3 route capture as `GSPOTrainer` sets it up for R3 + vLLM (`MoERouting.capture_vllm_routes`).
    `server_info`: what the client's `get_server_info` returns (by default it fails, as without vLLM's dev endpoints)."""
    from trl.generation import vllm_client, vllm_generation

    def init_like_trl(self):  # VLLMGeneration._init_vllm, server mode, minus the HTTP connection
        if self.accelerator.is_main_process:
            client = vllm_client.VLLMClient.__new__(vllm_client.VLLMClient)
            client.base_url, client.model, client._post = "http://stand-in:8000", "stand-in", server.post
            client.image_features = lambda images: [{"mm_placeholders": {"image": []}} for _ in images]
            if server_info is not None:
                client.get_server_info = lambda: server_info
            self.vllm_client = client

    original = vllm_generation.VLLMGeneration._init_vllm
    vllm_generation.VLLMGeneration._init_vllm = init_like_trl
    try:
        generation = vllm_generation.VLLMGeneration(
            model=trainer.model,
            accelerator=trainer.accelerator,
            processing_class=trainer.processing_class,
            mode="server",
            max_completion_length=trainer.args.max_completion_length,
            logprobs=0,
        )
    finally:
        vllm_generation.VLLMGeneration._init_vllm = original
    generation.sync_weights = lambda: None  # no server to push weights to
    generation._place_features = lambda features, prompt_ids: features
    trainer.use_vllm, trainer.vllm_generation, trainer._last_loaded_step = True, generation, -1
    trainer.vllm_importance_sampling_correction = False
    trainer.moe_routing.capture_vllm_routes(trainer.vllm_generation, trainer.accelerator)
    return generation


def expected_routes(prompt_ids, completion_ids, layers, top_k, num_experts):
    """What the trainer must hold for one row after ingesting the server's routes: the last token has none (-1)."""
    import torch

    routes = torch.from_numpy(routes_for(prompt_ids, completion_ids, layers, top_k, num_experts).astype(np.int64))
    return torch.cat([routes, routes.new_full((1, layers, top_k), -1)])


def check_rollout_routes(trainer, layers, top_k, num_experts):
    """Wrap `_generate_and_score_completions` to compare, on this process, every row's `old_routes` with what the
    server computed for that row's own prompt and completion. Returns a dict counting the checked rows."""
    import torch

    checked = {"rows": 0}
    generate = trainer._generate_and_score_completions

    def generate_and_check(batch):
        output = generate(batch)
        width = output["prompt_ids"].size(1)
        for i in range(output["prompt_ids"].size(0)):
            prompt = output["prompt_ids"][i][output["prompt_mask"][i].bool()].tolist()
            completion = output["completion_ids"][i][output["completion_mask"][i].bool()].tolist()
            want = expected_routes(prompt, completion, layers, top_k, num_experts)
            span = slice(width - len(prompt), width - len(prompt) + want.size(0))
            valid = output["old_routes_valid"][i, span]
            assert torch.equal(valid, (want >= 0).all(-1).all(-1)), f"row {i}: valid positions differ"
            assert torch.equal(output["old_routes"][i, span].long()[valid], want[valid]), f"row {i}: routes differ"
            checked["rows"] += 1
        return output

    trainer._generate_and_score_completions = generate_and_check
    return checked


def main():
    """2 processes (torchrun, gloo): R3 through the stand-in server for --max_steps steps; each rank checks its rows."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=2)
    cli = parser.parse_args()

    from datasets import Dataset

    from trl_gspo import GSPOConfig, GSPOTrainer
    from trl_gspo.testing import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    experts = 8
    model = build_tiny_model(tokenizer, moe=True, seed=0, num_experts=experts)
    args = GSPOConfig(
        output_dir=cli.output_dir,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        seed=0,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        learning_rate=5e-2,
        max_steps=cli.max_steps,
        logging_steps=1,
        disable_tqdm=True,
        routing_replay="R3",
    )
    prompts = ["copy 1 2 :", "add 3 4 5 6 =", "copy a :", "count 5 6 7 8 9"] * 4
    trainer = GSPOTrainer(
        model,
        lambda completions, **kw: [float(len(c.split()) % 3) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    hooks = trainer.moe_routing.hooks
    server = StandInServer(len(hooks.routers), hooks.top_k, hooks.num_experts)
    generation = server_generation(trainer, server)
    rank = trainer.accelerator.process_index
    checked = check_rollout_routes(trainer, len(hooks.routers), hooks.top_k, hooks.num_experts)
    trainer.train()
    client = "client" if getattr(generation, "vllm_client", None) is not None else "no client"
    print(f"R3 SERVER rank {rank} {client} checked {checked['rows']} rows, {len(server.requests)} requests", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
    main()
