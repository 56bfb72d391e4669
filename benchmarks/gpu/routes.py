"""The `vllm_routes` part of `make gpu-check` (the driver, check.py, runs it): does the installed vLLM return MoE routes
that trl-gspo's R3 can replay?

    python -m benchmarks.gpu routes --out /tmp/vllm-routes.json          # GPU + vLLM (what the driver runs)
    python -m benchmarks.gpu routes --dry-run                            # CPU, no vLLM (tests/test_gpu_check.py)

It builds a colocated `vllm.LLM(..., enable_return_routed_experts=True)` on an MoE model (default: a tiny Qwen3-MoE
built from config and saved to a temporary folder; `--model` for a real one), generates a few completions, reads
their routes through the same code the trainer uses (`route_sources.vllm_routes_from_outputs`,
`route_sources.routes_from_engine`), and re-scores every prompt + completion with the transformers model under
trl-gspo's router hooks. It reports the layout vLLM returned (type, dtype, rows vs prompt + completion tokens, layers)
and the sampler/trainer route mismatch: the share of (token, MoE layer) pairs, and of tokens in any layer, where the
trainer's router picks other experts than vLLM did. A layout trl-gspo does not know fails loudly here, before a run.

`--dry-run` replaces vLLM by a stand-in engine that samples with transformers `generate` and returns its recorded routes
in vLLM's first layout (`CompletionOutput.routed_experts`, int32, prompt + completion - 1 rows), so the script's path
is exercised on CPU (the test suite runs it). It imports no other module of this folder.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import types

PROMPTS = ["copy 1 2 3 :", "add 4 5 =", "what is the sum of 1 and 2 ?", "count 7 8 9"]


def stand_in_engine(model, hooks, tokenizer, max_tokens: int):
    """`generate(prompts, params)` with vLLM's output shape, from transformers `generate` and recorded routes."""
    import numpy as np
    import torch

    from trl_gspo.moe.route_sources import routes_from_generate

    def generate(prompts, sampling_params=None):
        ids = [p["prompt_token_ids"] for p in prompts]
        width = max(map(len, ids))
        batch = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in ids])
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids])
        with torch.no_grad(), hooks.log_calls() as log:
            out = model.generate(
                input_ids=batch,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                do_sample=True,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        completions = []
        for row in out[:, width:].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t == tokenizer.eos_token_id), len(row))
            completions.append(row[:end])
        routes = routes_from_generate(log, len(ids), [len(x) for x in ids], [len(c) for c in completions])
        return [
            types.SimpleNamespace(
                prompt_token_ids=x,
                outputs=[types.SimpleNamespace(token_ids=c, routed_experts=r[:-1].numpy().astype(np.int32))],
            )  # vLLM: P + C - 1 rows
            for x, c, r in zip(ids, completions, routes)
        ]

    return types.SimpleNamespace(generate=generate)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu routes", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default=None, help="MoE model folder or Hub id (default: tiny Qwen3-MoE from config)"
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU stand-in engine instead of vLLM")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", help="vLLM and trainer dtype (fp32 in --dry-run)")
    parser.add_argument("--out", default=None, help="write the report as JSON here")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_gspo.moe.route_sources import routes_from_engine, vllm_routes_from_outputs
    from trl_gspo.moe.routing import RouterHooks
    from trl_gspo.testing import save_tiny_model

    model_dir = args.model or save_tiny_model(tempfile.mkdtemp(prefix="tiny-moe-"), moe=True)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    dtype = torch.float32 if args.dry_run else getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    hooks = RouterHooks.for_model(model)
    if hooks is None:
        raise SystemExit(f"{model_dir} has no MoE routers: routing replay does not apply.")
    prompts = [{"prompt_token_ids": tokenizer(p)["input_ids"]} for p in PROMPTS]

    if args.dry_run:
        engine, params, version = stand_in_engine(model, hooks, tokenizer, args.max_tokens), None, "stand-in"
    else:
        import vllm

        engine = vllm.LLM(
            model=model_dir,
            dtype=args.dtype,
            enable_return_routed_experts=True,
            enforce_eager=True,
            gpu_memory_utilization=0.3,
            logprobs_mode="processed_logprobs",
        )
        params, version = vllm.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, logprobs=0), vllm.__version__
    outputs = engine.generate(prompts, params)
    raw = vllm_routes_from_outputs(outputs)

    config = model.config.get_text_config()
    layers = [r.decoder_layer for r in hooks.routers]
    report = {
        "engine": version,
        "model": args.model or "tiny Qwen3-MoE (from config)",
        "dtype": str(dtype),
        "moe_layers": len(layers),
        "top_k": hooks.top_k,
        "completions": [],
    }
    mismatch = [0, 0, 0, 0]  # differing (token, layer) pairs, pairs, tokens differing in any layer, tokens
    for request, r in zip(outputs, raw):
        completion = request.outputs[0].token_ids
        p, c = len(request.prompt_token_ids), len(completion)
        shape = getattr(r, "shape", None)
        entry = {
            "prompt_tokens": p,
            "completion_tokens": c,
            "type": type(r).__name__,
            "dtype": str(getattr(r, "dtype", "")),
            "shape": list(shape) if shape is not None else None,
        }
        routes = routes_from_engine(r, p, c, layers, config.num_hidden_layers, hooks.top_k, hooks.num_experts, "vLLM")
        ids = torch.tensor([list(request.prompt_token_ids) + list(completion)], device=device)
        with torch.no_grad(), hooks.forward_pass(1, p + c) as observed:
            model(input_ids=ids)
        native = observed.native_routes()[0].long().cpu()
        known = (routes >= 0).all(-1).all(-1)
        differs = (native.sort(-1).values != routes.sort(-1).values).any(-1) & known[:, None]
        entry["rows_with_route"] = int(known.sum())
        mismatch[0] += int(differs.sum())
        mismatch[1] += int(known.sum()) * routes.size(1)
        mismatch[2] += int(differs.any(-1).sum())
        mismatch[3] += int(known.sum())
        report["completions"].append(entry)
    report["mismatch_token_layer"] = mismatch[0] / max(mismatch[1], 1)
    report["mismatch_any_layer"] = mismatch[2] / max(mismatch[3], 1)
    print(json.dumps(report, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    return report
