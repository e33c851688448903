"""`run.loader(dataset)`: the role of DataLoader + DistributedSampler under gpuflex.

With `num_workers=0` a step's batch is read in the training process when the run asks for
it: `dataset[indices]` for a TensorDataset, else `collate_fn([dataset[i] for i in indices])`.

With `num_workers > 0` a torch DataLoader reads ahead in worker processes that live for
the whole run, across epochs and resizes: one DataLoader iterator, never exhausted, fed by
a stream of requests (step, rank, world size) that this process makes up lazily, one each
time the DataLoader wants a new one (its prefetch depth, num_workers x prefetch_factor, at
most outstanding). The stream guesses the next steps with the split of the step last
taken (its world size and the split plan's shares, both part of a request's key). When the
run wants a batch that was not asked for (after a resize or a re-plan the split differs;
after an undone step the step is earlier), the guess restarts there, and the
requests still outstanding are read and thrown away: at most the prefetch depth, and never
one that is yielded. So the loader yields exactly the batch the run wants, always.

Before the run starts, and past its last step, the stream asks for nothing (an empty
request, answered at once), so building the loader forks the workers before the runtime
starts any thread, and no sample is read twice at the start. The workers' own seeds come
from a generator seeded by the run's seed, not from the global RNG, which is state.
Requests and batches reach the workers through torch's own queues (pickled, between this
process and its forked children only), as with any DataLoader.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

from gpuflex.elastic import torch_compat
from gpuflex.elastic.data.sampler import Batch, ElasticSampler

Key = tuple   # (step, rank, world size, the plan's shares or None)
NOTHING: Key = (-1, 0, 0, None)


def read_batch(dataset: Any, indices: torch.Tensor | list[int], collate_fn: Any) -> Any:
    """The samples `indices` of `dataset`, collated."""
    if isinstance(dataset, TensorDataset) and collate_fn is None:
        return dataset[torch.as_tensor(indices, dtype=torch.long)]
    idx = indices.tolist() if isinstance(indices, torch.Tensor) else indices
    return (collate_fn or default_collate)([dataset[i] for i in idx])


class _Requests(torch.utils.data.Dataset):
    """Map-style: a request (key, indices) -> (key, the collated batch), in a worker."""

    def __init__(self, dataset: Any, collate_fn: Any) -> None:
        self.dataset, self.collate_fn = dataset, collate_fn

    def __getitem__(self, request: tuple[Key, list[int]]) -> tuple[Key, Any]:
        key, indices = request
        if key == NOTHING:
            return key, None
        return key, read_batch(self.dataset, indices, self.collate_fn)


def _as_is(item: Any) -> Any:   # the request already made the batch
    return item


class RequestStream:
    """The requests, made one at a time as the DataLoader wants them: the steps after the
    one last asked for, with its split; `outstanding` are the keys asked for and not yet read."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler
        self.cursor: Key | None = None
        self.outstanding: collections.deque[Key] = collections.deque()

    def restart(self, key: Key) -> None:
        self.cursor = key

    def __iter__(self) -> Iterator[tuple[Key, list[int]]]:
        while True:
            key = self.cursor
            if key is None or key[0] >= self.sampler.total_steps:
                request: tuple[Key, list[int]] = (NOTHING, [])
            else:
                step, rank, world, shares = key
                request = (key, self.sampler.batch(step, rank, world, shares).indices.tolist())
                self.cursor = (step + 1, rank, world, shares)
            self.outstanding.append(request[0])
            yield request


class Prefetcher:
    """The run-long DataLoader iterator and its request stream."""

    def __init__(self, dataset: Any, sampler: ElasticSampler, num_workers: int, pin_memory: bool = False,
                 collate_fn: Any = None, prefetch_factor: int | None = None) -> None:
        self.stream = RequestStream(sampler)
        self.loader = DataLoader(_Requests(dataset, collate_fn), batch_size=None, sampler=self.stream,
                                 collate_fn=_as_is, num_workers=num_workers, pin_memory=pin_memory,
                                 prefetch_factor=prefetch_factor,
                                 generator=torch.Generator().manual_seed(sampler.seed))
        self.it: Iterator[Any] | None = iter(self.loader)   # forks the workers now
        self._shutdown: Callable[[], None] | None = torch_compat.loader_shutdown(self.it)
        self.discarded = 0
        self.served = -1   # the step of the last batch given

    def get(self, batch: Batch) -> Any:
        """Exactly the batch of `batch` (its step, rank, world size and shares)."""
        key = (batch.step, batch.rank, batch.world_size, batch.shares)
        stream = self.stream
        if key not in stream.outstanding:
            stream.restart(key)
        while True:
            expected = stream.outstanding.popleft()
            got, data = next(self.it)
            if got != expected:
                raise RuntimeError(f"loader: got the batch of {got}, expected {expected} (runtime bug)")
            if got == key:
                self.served = key[0]
                return data
            self.discarded += 1

    def close(self) -> None:
        """End the worker processes."""
        shutdown, self.it, self._shutdown = self._shutdown, None, None
        if shutdown is not None:
            shutdown()


class ElasticLoader:
    """Iterates this rank's share of each step as data (the role of DataLoader +
    DistributedSampler). `scope()` gives the steps an iteration starting now covers (inside
    `run.epochs()`: the rest of the current epoch; outside: the rest of the run) and their
    number; the read-ahead workers end with the run's last step."""

    def __init__(self, scope: Callable[[], tuple[Iterator[Batch], int]], dataset: Any,
                 collate_fn: Any = None, prefetcher: Prefetcher | None = None) -> None:
        self.scope = scope
        self.dataset, self.collate_fn = dataset, collate_fn
        self.prefetcher = prefetcher

    def __len__(self) -> int:
        return self.scope()[1]

    def __iter__(self) -> Iterator[Any]:
        pre = self.prefetcher
        steps, _ = self.scope()
        try:
            for batch in steps:
                yield read_batch(self.dataset, batch.indices, self.collate_fn) if pre is None else pre.get(batch)
        finally:
            if pre is not None and pre.served == pre.stream.sampler.total_steps - 1:   # the run is over
                pre.close()

    def close(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.close()
