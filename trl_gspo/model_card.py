"""What a saved or pushed model's card says about how it was trained: the variant, its paper and tags.

TRL's trainers fill the card (`BaseTrainer.create_model_card`) from three class attributes, `_name`, `_paper` and
`_tag_names`; `GSPOTrainer` sets them per run, since one trainer class trains three algorithms.
"""

from __future__ import annotations

import textwrap

GSPO_PAPER = {
    "title": "Group Sequence Policy Optimization",
    "id": "2507.18071",
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @article{zheng2025gspo,
            title        = {{Group Sequence Policy Optimization}},
            author       = {Chujie Zheng and Shixuan Liu and Mingze Li and Xiong-Hui Chen and Bowen Yu and Chang Gao and Kai Dang and Yuqiong Liu and Rui Men and An Yang and Jingren Zhou and Junyang Lin},
            year         = 2025,
            eprint       = {arXiv:2507.18071},
        }"""),
}

#: importance_sampling_level -> (trainer name shown on the card, tags besides "trl" and "trl-gspo").
VARIANTS = {
    "sequence": ("GSPO", ["gspo"]),
    "sequence_token": ("GSPO-token", ["gspo", "gspo-token"]),
    "token": ("GRPO", ["grpo"]),
}


def card_fields(level: str, loss_type: str, grpo_paper: dict) -> tuple[str, dict, list[str]]:
    """(`_name`, `_paper`, `_tag_names`) for a run: GSPO's paper for the sequence levels, GRPO's for `token`."""
    name, tags = VARIANTS[level]
    if loss_type != "grpo":
        name = f"{name} ({loss_type} loss)"
    paper = grpo_paper if level == "token" else GSPO_PAPER
    return name, paper, ["trl", "trl-gspo", *tags]
