"""`run.loader(dataset)`: the role of DataLoader + DistributedSampler under gpuflex."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator

from torch.utils.data import TensorDataset, default_collate

if TYPE_CHECKING:
    from gpuflex.elastic.runtime import ElasticRun


class ElasticLoader:
    """Iterates this rank's share of each step of the current epoch as data (the role of
    DataLoader + DistributedSampler): `dataset[indices]` for a TensorDataset, else
    `collate_fn([dataset[i] for i in indices])`."""

    def __init__(self, run: "ElasticRun", dataset: Any, collate_fn: Any = None) -> None:
        self.run, self.dataset = run, dataset
        self.collate_fn = collate_fn

    def __len__(self) -> int:
        return self.run.sampler.steps_per_epoch

    def __iter__(self) -> Iterator[Any]:
        for batch in self.run._steps(epoch=self.run.epoch):
            if isinstance(self.dataset, TensorDataset) and self.collate_fn is None:
                yield self.dataset[batch.indices]
            else:
                yield (self.collate_fn or default_collate)([self.dataset[i] for i in batch.indices.tolist()])
