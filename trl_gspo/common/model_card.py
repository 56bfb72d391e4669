"""What a saved or pushed model's card says about how it was trained: the variant, its paper and tags.

TRL's trainers fill the card (`BaseTrainer.create_model_card`) from three class attributes, `_name`, `_paper` and
`_tag_names`; `GSPOTrainer` sets them per run, since one trainer class trains three algorithms. TRL names the base
model only when it is a Hub id ("fine-tuned version of [None]" for a local folder); `name_local_base_model` puts
the folder's name there instead.
"""

from __future__ import annotations

import os
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

#: The loss type of the GSPO paper (and GSPOConfig's default): a card names any other.
PAPER_LOSS_TYPE = "grpo"
#: importance_sampling_level -> (trainer name shown on the card, tags besides "trl" and "trl-gspo").
VARIANTS = {
    "sequence": ("GSPO", ["gspo"]),
    "sequence_token": ("GSPO-token", ["gspo", "gspo-token"]),
    "token": ("GRPO", ["grpo"]),
}


def card_fields(level: str, loss_type: str, grpo_paper: dict) -> tuple[str, dict, list[str]]:
    """(`_name`, `_paper`, `_tag_names`) for a run: GSPO's paper for the sequence levels, GRPO's for `token`."""
    name, tags = VARIANTS[level]
    name += {PAPER_LOSS_TYPE: ""}.get(loss_type, f" ({loss_type} loss)")  # the loss type, when not the paper's
    paper = grpo_paper if level == "token" else GSPO_PAPER
    return name, paper, ["trl", "trl-gspo", *tags]


#: What TRL's card template (`lm_model_card.md`) renders for a base model it does not name.
UNNAMED_BASE = "[None](https://huggingface.co/None)"


def name_local_base_model(card_path: str, name_or_path: str | None) -> None:
    """In the card at `card_path`, name a base model loaded from a local folder by the folder's name (no Hub link:
    it is not a Hub repository). Leaves cards of Hub models, and cards TRL already filled, untouched."""
    if not name_or_path or not os.path.isdir(name_or_path) or not os.path.exists(card_path):
        return
    with open(card_path, encoding="utf-8") as f:
        card = f.read()
    if UNNAMED_BASE not in card:
        return
    folder = os.path.basename(os.path.normpath(name_or_path))
    with open(card_path, "w", encoding="utf-8") as f:
        f.write(card.replace(UNNAMED_BASE, f"`{folder}` (a local model folder)"))
