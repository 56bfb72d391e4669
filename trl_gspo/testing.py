"""Tiny models and a word-level tokenizer built in code, for offline tests, the demo, benchmarks and a first try.

    from trl_gspo.testing import build_tiny_model, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_tiny_model(tokenizer)  # a random Qwen3 of two layers; moe=True for Qwen3-MoE

Nothing here downloads anything: configs come from `transformers`, the tokenizer from `tokenizers`. The models are
random and tiny (two layers, hidden size 64 by default): they show that training runs and learns a toy task (the
demo's), not what a real model learns.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    GptOssConfig,
    MixtralConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

SPECIAL_TOKENS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
#: Enough words for arithmetic / copy tasks and chat-formatted prompts.
WORDS = [str(d) for d in range(10)] + (
    "+ - = ? : . , answer what is add copy repeat count the sum of and a b c d yes no user assistant system think "
    "</think> <think> turn tool result next"
).split()

# Qwen-style ChatML template in Jinja, so conversational datasets and TRL's chat handling work unchanged.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)


def build_tokenizer(extra_words: list[str] | None = None) -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with pad/eos tokens and a chat template."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS + list(extra_words or []))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|im_end|>",
        unk_token="<unk>",
        bos_token=None,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(vocab_size: int, moe: bool = False, hidden_size: int = 64, num_layers: int = 2, **overrides):
    """Config of a tiny Qwen3 (or Qwen3-MoE: 4 experts, top-2, router aux loss on)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
    )
    if moe:
        # output_router_logits stays False in the saved config: transformers' generate() crashes computing the
        # aux loss on left-padded batches; TRL asks for router logits itself in its log-prob forward.
        moe_kwargs = dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=hidden_size,
            decoder_sparse_step=1,
            router_aux_loss_coef=0.01,
            output_router_logits=False,
        )
        return Qwen3MoeConfig(**{**common, **moe_kwargs, **overrides})
    return Qwen3Config(**{**common, **overrides})


def tiny_moe_config(
    arch: str,
    vocab_size: int,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    **overrides,
):
    """Config of a tiny MoE model of another architecture with a router routing replay supports, for tests:
    ``qwen3_moe``, ``qwen2_moe`` (shared expert), ``mixtral``, ``deepseek_v3`` (sigmoid router, expert groups,
    first layer dense, so MoE layers are decoder layers 1..) and ``gpt_oss`` (router bias, softmax over the top-k)."""
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    head_dim = hidden_size // 4
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            **common,
            intermediate_size=2 * hidden_size,
            head_dim=head_dim,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=hidden_size,
            norm_topk_prob=True,
            output_router_logits=False,
        )
    elif arch == "qwen2_moe":
        config = Qwen2MoeConfig(
            **common,
            intermediate_size=2 * hidden_size,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=hidden_size,
            shared_expert_intermediate_size=hidden_size,
            norm_topk_prob=False,
            output_router_logits=False,
        )
    elif arch == "mixtral":
        config = MixtralConfig(
            **common,
            intermediate_size=hidden_size,
            head_dim=head_dim,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            router_jitter_noise=0.0,
            output_router_logits=False,
        )
    elif arch == "deepseek_v3":
        config = DeepseekV3Config(
            **{**common, "num_key_value_heads": 4, "num_hidden_layers": num_layers + 1},
            intermediate_size=2 * hidden_size,
            moe_intermediate_size=hidden_size,
            n_shared_experts=1,
            n_routed_experts=num_experts,
            n_group=2,
            topk_group=1,
            num_experts_per_tok=top_k,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=head_dim,
            v_head_dim=head_dim,
            qk_nope_head_dim=head_dim,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    elif arch == "gpt_oss":
        config = GptOssConfig(
            **common,
            intermediate_size=hidden_size,
            head_dim=head_dim,
            num_local_experts=num_experts,
            num_experts_per_tok=top_k,
            sliding_window=64,
            output_router_logits=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )
    else:
        raise ValueError(
            f"arch={arch!r}: tiny MoE configs exist for qwen3_moe, qwen2_moe, mixtral, deepseek_v3, gpt_oss."
        )
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def build_tiny_model(tokenizer, moe: bool = False, seed: int = 0, **config_overrides):
    """A randomly initialised tiny causal LM matching `tokenizer`'s vocabulary (fp32)."""
    torch.manual_seed(seed)
    config = tiny_config(len(tokenizer), moe=moe, **config_overrides)
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save_tiny_model(
    path: str | os.PathLike, moe: bool = False, seed: int = 0, extra_words: list[str] | None = None, **config_overrides
) -> str:
    """Build and save a tiny model + tokenizer (with `extra_words` appended to its vocabulary) to `path`; loadable with
    `from_pretrained(path)`."""
    tokenizer = build_tokenizer(extra_words)
    model = build_tiny_model(tokenizer, moe=moe, seed=seed, **config_overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
