"""The sample order from pure functions, not iterator state, exact at any world size: a held-out slice, a seeded
permutation per epoch, step s taking its positions [s*G, (s+1)*G) and rank r the r-th contiguous slice of those.
So the only position to save is the optimizer step."""

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
    The first G mod W ranks take ceil(G/W) sequences, the others floor(G/W), in micro-batches of at most m. A
    weight is the micro-batch's exact share of the global batch (every row scores seq_len targets): they sum to 1."""
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


@dataclass
class RankOrder:
    """The sample id at each position of one rank's stream that starts at optimizer step `start_step` (both streams
    read through it). `train_ids` None: remade from `num_sequences` wherever it is unpickled (a few bytes to send)."""

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
        # int32 where the ids fit: the ids and two epoch orders then take 4 bytes a sample (the same order)
        ids = np.asarray(self.train_ids)
        self.train_ids = ids.astype(np.int32) if len(ids) == 0 or int(ids.max()) < 2**31 else ids.astype(np.int64)
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
