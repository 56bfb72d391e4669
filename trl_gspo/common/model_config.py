"""What the package reads from a transformers model config."""

from __future__ import annotations


def text_config(config):
    """The language model's config: a vision-language model's text config, any other model's config itself (the
    attention, router and vocabulary fields every path reads live there)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config
