"""The stream's position -> sample id map (`minilm.data.RankOrder`) against the order contract written out
plainly here, exhaustively over small configurations: any start step, any world size, across epoch boundaries."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from minilm import data as D
from minilm.data import RankOrder


def expected_ids(train_ids, seed, spe, G, W, rank, start_step, end_step):
    """What the rank consumes from start_step to end_step: step s of epoch e is positions [s*G, (s+1)*G) of
    epoch e's permutation, and rank r reads the r-th G/W slice of it."""
    out = []
    for step in range(start_step, end_step):
        epoch, s = divmod(step, spe)
        global_batch = D.epoch_order(train_ids, seed, epoch)[s * G:(s + 1) * G]
        out.append(global_batch[rank * (G // W):(rank + 1) * (G // W)])
    return np.concatenate(out)


@pytest.mark.parametrize("G, W", [(4, 1), (4, 2), (4, 4), (12, 3), (12, 2), (8, 8)])
def test_positions_map_to_the_ids_of_each_step(G, W):
    train_ids = np.arange(3, 3 + 37)  # 37 training ids: the tail of each epoch waits for the next order
    spe = D.steps_per_epoch(len(train_ids), G)
    end = 3 * spe + 1
    for rank, start in itertools.product(range(W), range(end)):
        order = RankOrder(train_ids, seed=7, steps_per_epoch=spe, global_batch_size=G, world_size=W, rank=rank,
                          start_step=start)
        n = (end - start) * (G // W)
        want = expected_ids(train_ids, 7, spe, G, W, rank, start, end)
        assert np.array_equal(order.sample_ids(np.arange(n)), want)
        # in arbitrary batches (the reader sees micro-batches), the same answer
        cuts = sorted({0, n, *range(0, n, 3)})
        pieces = [order.sample_ids(np.arange(a, b)) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert np.array_equal(np.concatenate(pieces) if pieces else np.array([], np.int64), want)


def test_every_training_id_once_per_epoch_over_all_ranks():
    train_ids, G, W = np.arange(100), 20, 4
    spe = D.steps_per_epoch(len(train_ids), G)
    per_rank = G // W
    seen = np.concatenate([RankOrder(train_ids, 1, spe, G, W, r, 0).sample_ids(np.arange(spe * per_rank))
                           for r in range(W)])
    assert sorted(seen.tolist()) == list(range(100))


def test_an_order_of_a_split_pickles_without_its_ids_and_reads_the_same():
    """A reader gets the order pickled: with `num_sequences` it carries no id array and remakes the ids from
    split_ids, so the ids it reads are the trainer's."""
    import pickle

    train_ids, _ = D.split_ids(100_000, 500)
    order = RankOrder(train_ids, 3, D.steps_per_epoch(len(train_ids), 64), 64, 4, 2, 1555,
                      num_sequences=100_000, val_samples=500)
    order.sample_ids(np.arange(10))  # fills the epoch cache, which does not travel either
    blob = pickle.dumps(order)
    assert len(blob) < 1000 < len(pickle.dumps(train_ids))
    positions = np.arange(0, 64 * 30, 7)
    assert np.array_equal(pickle.loads(blob).sample_ids(positions), order.sample_ids(positions))
    assert np.array_equal(order.sample_ids(positions), RankOrder(train_ids, 3, order.steps_per_epoch, 64, 4, 2,
                                                                 1555).sample_ids(positions))
