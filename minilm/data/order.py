"""The sample order, and the resume contract it keeps: exact at any world size.

The resumable iterator Ray Data lacks (ray-project/ray#37633, #48224) is built from pure functions
instead of iterator state:

* `split_ids(N, val_samples)`: a fixed held-out slice, the rest the training ids;
* `epoch_order(train_ids, seed, epoch)`: a seeded permutation of the training sample ids;
* optimizer step s of an epoch consumes positions [s*G, (s+1)*G) of that order (G = global batch),
  whatever the world size;
* worker r of W takes the r-th contiguous slice of each global batch, floor or ceil(G/W) ids, and reads it
  in micro-batches of at most m (`rank_micro_batches`, the one place this arithmetic lives; `RankOrder`).

So the only position to save is the optimizer step (samples_seen = step * G), and a resumed run at
any world size consumes exactly the samples the uninterrupted run would have, step by step.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import numpy as np

from .format import DataError

VAL_SEED = 0x5EED  # the held-out slice is fixed, independent of the training seed


def check_val_samples(num_sequences: int, val_samples: int) -> None:
    if val_samples < 0 or val_samples >= num_sequences:
        raise DataError(f"val_samples {val_samples} must be in [0, {num_sequences}) for a dataset of "
                        f"{num_sequences} sequences")


def split_ids(num_sequences: int, val_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_ids, val_ids): a fixed held-out slice, disjoint from training, same for every seed."""
    check_val_samples(num_sequences, val_samples)
    rng = np.random.default_rng(VAL_SEED)
    val = np.sort(rng.choice(num_sequences, size=val_samples, replace=False)) if val_samples else np.array([], np.int64)
    mask = np.ones(num_sequences, dtype=bool)
    mask[val] = False
    return np.flatnonzero(mask).astype(np.int64), val.astype(np.int64)


def epoch_order(train_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The training ids in this epoch's order: a permutation seeded by (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return train_ids[rng.permutation(len(train_ids))]


def steps_per_epoch(num_train: int, global_batch_size: int) -> int:
    """Whole global batches per epoch; the remainder (< one batch) waits for the next epoch's order."""
    return num_train // global_batch_size


def rank_micro_batches(global_batch_size: int, micro_batch_size: int, world_size: int,
                       rank: int) -> list[tuple[int, int, Fraction]]:
    """Rank `rank`'s micro-batches of a global batch at world size W: (start, stop, weight) each, positions in the batch.

    The first G mod W ranks take ceil(G/W) sequences, the others floor(G/W), contiguous and in rank order; each
    slice is read in micro-batches of at most m, the last one smaller. A micro-batch's weight is its share of the
    global batch's scored tokens (every row scores seq_len targets: no padding, and a document mask hides no
    target), exact, so the weights of all ranks sum to 1 and the all-reduced gradient is the global batch's mean loss's.
    """
    if not 1 <= world_size <= global_batch_size or not 0 <= rank < world_size or micro_batch_size < 1:
        raise ValueError(f"no rank {rank} of world size {world_size} for a global batch of {global_batch_size}")
    base, extra = divmod(global_batch_size, world_size)
    start = rank * base + min(rank, extra)
    stop = start + base + (rank < extra)
    return [(a, min(a + micro_batch_size, stop), Fraction(min(a + micro_batch_size, stop) - a, global_batch_size))
            for a in range(start, stop, micro_batch_size)]


@dataclass
class DataPosition:
    """Where the run is in its data, derived from the optimizer step alone."""

    epoch: int
    step_in_epoch: int
    samples_seen: int

    @classmethod
    def at(cls, optimizer_step: int, steps_per_epoch: int, global_batch_size: int) -> DataPosition:
        return cls(epoch=optimizer_step // steps_per_epoch, step_in_epoch=optimizer_step % steps_per_epoch,
                   samples_seen=optimizer_step * global_batch_size)


def compact_ids(ids: np.ndarray) -> np.ndarray:
    """Sample ids as int32 when they fit: the ids and two epoch orders then take 4 bytes a sample, not 8."""
    ids = np.asarray(ids)
    return ids.astype(np.int32) if len(ids) == 0 or int(ids.max()) < 2**31 else ids.astype(np.int64)


@dataclass
class RankOrder:
    """The sample id at each position of one rank's stream that starts at optimizer step `start_step`.

    With n = `per_rank` (floor or ceil(G/W)) and a = the slice's start (`rank_micro_batches`), position p
    belongs to optimizer step s = start_step + p // n, as its k-th id, k = p % n: the id at index
    (s mod steps_per_epoch) * G + a + k of epoch (s // steps_per_epoch)'s order. Both streams (`ray_jobs.stream.RankStream`, `LocalRankStream`) read through it.

    `train_ids` may be None when `num_sequences` is given: they are then `split_ids(num_sequences,
    val_samples)[0]`, remade wherever the order is unpickled, so it travels to a reader as a few bytes.
    """

    train_ids: np.ndarray | None
    seed: int
    steps_per_epoch: int
    global_batch_size: int
    world_size: int
    rank: int
    start_step: int
    num_sequences: int | None = None
    val_samples: int = 0

    def __post_init__(self):
        if self.train_ids is None:
            self.train_ids = split_ids(self.num_sequences, self.val_samples)[0]
        self.train_ids = compact_ids(self.train_ids)  # the same values, so the same order
        self._orders: dict[int, np.ndarray] = {}

    def __getstate__(self):
        rebuilt = self.num_sequences is not None
        return {**self.__dict__, "_orders": {}, "train_ids": None if rebuilt else self.train_ids}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.__post_init__()

    def micro_batches(self, micro_batch_size: int) -> list[tuple[int, int, Fraction]]:
        return rank_micro_batches(self.global_batch_size, micro_batch_size, self.world_size, self.rank)

    @property
    def per_rank(self) -> int:
        """Sample ids this rank reads per optimizer step."""
        start, stop, _ = self.micro_batches(self.global_batch_size)[0]  # the whole slice as one micro-batch
        return stop - start

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        per_rank, first = self.per_rank, self.micro_batches(self.global_batch_size)[0][0]
        absolute = self.start_step * per_rank + np.asarray(positions, dtype=np.int64)
        step, k = absolute // per_rank, absolute % per_rank
        epoch, step_in_epoch = step // self.steps_per_epoch, step % self.steps_per_epoch
        index = step_in_epoch * self.global_batch_size + first + k  # into the epoch's order
        out = np.empty(len(absolute), dtype=np.int64)
        for e in np.unique(epoch):
            selected = epoch == e
            out[selected] = self._order(int(e))[index[selected]]
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.train_ids, self.seed, epoch)
        return self._orders[epoch]
