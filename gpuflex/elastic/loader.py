"""`run.loader(dataset)`: the role of DataLoader + DistributedSampler under gpuflex."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from torch.utils.data import TensorDataset, default_collate

from gpuflex.elastic.sampler import Batch


class ElasticLoader:
    """Iterates this rank's share of each step of the current epoch as data (the role of
    DataLoader + DistributedSampler): `dataset[indices]` for a TensorDataset, else
    `collate_fn([dataset[i] for i in indices])`. `epoch_steps()` gives the run's remaining
    steps of its current epoch."""

    def __init__(self, epoch_steps: Callable[[], Iterator[Batch]], steps_per_epoch: int,
                 dataset: Any, collate_fn: Any = None) -> None:
        self.epoch_steps, self.steps_per_epoch = epoch_steps, steps_per_epoch
        self.dataset, self.collate_fn = dataset, collate_fn

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        for batch in self.epoch_steps():
            if isinstance(self.dataset, TensorDataset) and self.collate_fn is None:
                yield self.dataset[batch.indices]
            else:
                yield (self.collate_fn or default_collate)([self.dataset[i] for i in batch.indices.tolist()])
