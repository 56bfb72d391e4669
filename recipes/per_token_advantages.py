"""Per-token advantages for GSPO-token, used by recipes/qwen3_1p7b_gspo_token.yaml (`trainer_class`).

GSPO-token (`importance_sampling_level: sequence_token`) keeps GSPO's sequence-level ratio but lets every token
carry its own advantage. The hook is `GSPOTrainer.token_advantages(inputs)`: return `(B,)` for one advantage per
completion (TRL's default) or `(B, T)` for one per token. This example credits a repetition penalty to exactly
the tokens that repeat: a token that closes an n-gram already seen earlier in the same completion gets
`advantage - penalty`; every other token keeps its completion's advantage. Long reasoning answers that loop are
thus pushed down where they loop, without touching the rest of the answer.
"""

import torch

from trl_gspo import GSPOTrainer


def repeated_ngram_mask(completion_ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T) float: 1 where the token ends an n-gram that already occurred earlier in its (valid) completion."""
    repeated = torch.zeros(completion_ids.shape, dtype=torch.float32)
    for b, (ids, valid) in enumerate(zip(completion_ids.tolist(), mask.tolist())):
        seen = set()
        for t in range(n - 1, len(ids)):
            if not valid[t]:
                break
            gram = tuple(ids[t - n + 1 : t + 1])
            if gram in seen:
                repeated[b, t] = 1.0
            seen.add(gram)
    return repeated.to(completion_ids.device)


class RepetitionPenaltyTrainer(GSPOTrainer):
    """GSPO-token trainer whose per-token advantage subtracts `penalty` on tokens that repeat an `ngram`."""

    ngram = 4
    penalty = 0.1

    def token_advantages(self, inputs):
        advantages = inputs["advantages"].unsqueeze(1)  # (B, 1): TRL's per-completion advantage
        repeated = repeated_ngram_mask(inputs["completion_ids"], inputs["completion_mask"], self.ngram)
        return advantages - self.penalty * repeated
