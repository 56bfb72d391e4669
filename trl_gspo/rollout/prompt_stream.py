"""`PromptStream`: the local generation batch of any rollout, computed from the sampler's definition, so a rollout
source can read ahead (into the next epoch too) and resume anywhere.

TRL's train dataloader hands `_prepare_inputs` the local generation batch of each rollout, repeated for every
micro-step that trains on it. Its `RepeatSampler` works in chunks of `generation_batch_size / num_generations`
prompts: every epoch it draws one permutation of the dataset from a generator seeded once with `args.seed` (the
e-th draw for epoch e, or the identity without `shuffle_dataset`), cuts it into chunks (dropping an incomplete last
one), and yields each chunk's prompts `num_generations` times each. accelerate deals the resulting rows to processes
in blocks of `per_device_train_batch_size * steps_per_generation`, so process p holds block p of every chunk.

The stream computes the same thing for rollout r = (epoch, chunk) without iterating the dataloader: what a source
that generates ahead of time or draws extra prompts asks for. `tests/test_rollout.py` checks it against TRL's own
dataloader across epoch boundaries. Iterable datasets have no index to compute from: `PromptStream.for_trainer`
refuses them.
"""

from __future__ import annotations

import torch


class PromptStream:
    """Local generation batches by rollout index (0-based from the start of training, across epochs)."""

    def __init__(
        self,
        dataset,
        prompts_per_rollout: int,
        num_generations: int,
        local_rows: int,
        process_index: int,
        seed: int | None,
        shuffle: bool,
        collate=lambda rows: rows,
    ):
        if shuffle and seed is None:
            raise ValueError("PromptStream needs a seed to reproduce the sampler's shuffled order (args.seed=None).")
        if len(dataset) < prompts_per_rollout:
            raise ValueError(
                f"The training dataset has {len(dataset)} prompts, fewer than one rollout batch needs "
                f"({prompts_per_rollout} = generation_batch_size / num_generations)."
            )
        self.dataset, self.collate = dataset, collate
        self.prompts_per_rollout, self.num_generations = prompts_per_rollout, num_generations
        self.local_rows, self.process_index = local_rows, process_index
        self.seed, self.shuffle = seed, shuffle
        self.rollouts_per_epoch = len(dataset) // prompts_per_rollout
        self._permutations: dict[int, torch.Tensor] = {}  # recent epochs' dataset orders (older ones are redrawn)
        self._generator, self._drawn = None, 0  # the sampler's generator and how many epochs it has drawn

    @classmethod
    def for_trainer(cls, trainer) -> PromptStream:
        """The stream of `trainer`'s training data, as its train dataloader deals it to this process."""
        dataset = trainer.train_dataset
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__getitem__"):
            raise ValueError(
                "This rollout source reads prompts ahead of the dataloader, which needs an indexable (map-style) "
                f"training dataset; got {type(dataset).__name__}. Load the dataset without streaming."
            )
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):  # the columns the dataloader keeps (HF's remove_unused_columns)
                dataset = trainer._remove_unused_columns(dataset, description="training")
        except ImportError:
            pass
        args = trainer.args
        return cls(
            dataset,
            prompts_per_rollout=args.generation_batch_size // trainer.num_generations,
            num_generations=trainer.num_generations,
            local_rows=args.per_device_train_batch_size * args.steps_per_generation,
            process_index=trainer.accelerator.process_index,
            seed=args.seed,
            shuffle=trainer.shuffle_dataset,
            collate=trainer.data_collator,
        )

    def prompt_indices(self, rollout: int) -> list[int]:
        """Dataset indices of the prompts of `rollout`, for all processes (each `num_generations` times in the batch)."""
        epoch, chunk = divmod(rollout, self.rollouts_per_epoch)
        order = self._permutation(epoch)
        return order[chunk * self.prompts_per_rollout : (chunk + 1) * self.prompts_per_rollout].tolist()

    def batch(self, rollout: int) -> list:
        """This process's local generation batch of `rollout`, as the train dataloader yields it."""
        rows = [i for i in self.prompt_indices(rollout) for _ in range(self.num_generations)]
        local = rows[self.process_index * self.local_rows : (self.process_index + 1) * self.local_rows]
        return self.collate([self.dataset[i] for i in local])

    def _permutation(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(len(self.dataset))
        if epoch not in self._permutations:
            if self._generator is None or epoch < self._drawn:  # (re)start the draws from the seed
                self._generator, self._drawn = torch.Generator(), 0
                self._generator.manual_seed(self.seed)
            while self._drawn <= epoch:  # draws are sequential: epoch e is the e-th permutation of the seed
                order = torch.randperm(len(self.dataset), generator=self._generator)
                self._drawn += 1
                if self._drawn - 1 >= epoch - 1:  # keep this epoch and the one before it, not the whole history
                    self._permutations[self._drawn - 1] = order
            self._permutations = {e: p for e, p in self._permutations.items() if e >= epoch - 1}
        return self._permutations[epoch]
