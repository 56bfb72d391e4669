"""What the package reads from a transformers model config."""

from __future__ import annotations

#: Config fields that fix the weights' names and shapes; compared where both configs set them (text config of each).
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_experts",
    "num_local_experts",
    "moe_intermediate_size",
    "num_experts_per_tok",
)


def text_config(config):
    """The language model's config: a vision-language model's text config, any other model's config itself (the
    attention, router and vocabulary fields every path reads live there)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shape_differences(ours, theirs) -> list[tuple[str, object, object]]:
    """`(field, ours, theirs)` for each field of `SHAPE_FIELDS` that both text configs set to different values: two
    configs with none describe weights of the same names and shapes."""
    ours, theirs = text_config(ours), text_config(theirs)
    differences = []
    for field in SHAPE_FIELDS:
        mine, other = getattr(ours, field, None), getattr(theirs, field, None)
        if mine is not None and other is not None and mine != other:
            differences.append((field, mine, other))
    return differences
