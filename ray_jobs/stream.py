"""Each worker's stream of micro-batches, through Ray Data, from any resume point.

Ray Data has no resumable iterator (ray-project/ray#37633, #48224), and `streaming_split` does not
promise which rank gets which rows. So the order is ours (`minilm.data`: a pure function of seed,
epoch, optimizer step, rank and world size) and Ray Data does the streaming. Each worker streams
one dataset for the rest of the run: the positions 0, 1, 2, ... of what this rank will consume
from its resume step to the last step (`ray.data.range`, lazy, no id array held anywhere); a
`map_batches` actor turns positions into sample ids (`RankOrder`) and reads those rows from the
parquet shards; `iter_torch_batches` prefetches them while the step runs. Epoch boundaries are
just positions, so no pipeline starts mid-run; restarting at any step, at any world size, is
building the same pipeline from a different first step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import ray
import torch

from minilm import data as D


@dataclass
class RankOrder:
    """The sample id at each position of one rank's stream that starts at optimizer step `start_step`.

    Position p is the k-th id of optimizer step s = start_step + p // (G/W), k = p % (G/W): the same
    id `minilm.data.rank_sample_ids` gives for that step of its epoch.
    """

    train_ids: np.ndarray
    seed: int
    steps_per_epoch: int
    global_batch_size: int
    world_size: int
    rank: int
    start_step: int

    def __post_init__(self):
        self._orders: dict[int, np.ndarray] = {}

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        per_rank = self.global_batch_size // self.world_size
        absolute = self.start_step * per_rank + np.asarray(positions, dtype=np.int64)
        step, k = absolute // per_rank, absolute % per_rank
        epoch, step_in_epoch = step // self.steps_per_epoch, step % self.steps_per_epoch
        index = step_in_epoch * self.global_batch_size + self.rank * per_rank + k  # into the epoch's order
        out = np.empty(len(absolute), dtype=np.int64)
        for e in np.unique(epoch):
            selected = epoch == e
            out[selected] = self._order(int(e))[index[selected]]
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = D.epoch_order(self.train_ids, self.seed, epoch)
        return self._orders[epoch]


class ReadSequences:
    """Ray Data callable class: stream positions in, sample ids and packed rows out (shards cached)."""

    def __init__(self, data_dir: str, order: RankOrder):
        self.store = D.SequenceStore(D.open_prepared(data_dir))
        self.order = order

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = self.order.sample_ids(batch["id"])
        return {"sample_id": ids, "input_ids": self.store.take(ids)}


def rank_dataset(order: RankOrder, num_positions: int, data_dir: str, micro_batch_size: int, reader_cpus: float):
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the order is the resume contract
    ctx.enable_progress_bars = False  # one pipeline per worker: bars would drown the log line
    ctx.print_on_execution_start = False
    return ray.data.range(num_positions).map_batches(
        ReadSequences, fn_constructor_args=(data_dir, order), batch_size=micro_batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=reader_cpus)


class RankStream:
    """Micro-batches for one rank from optimizer step `start_step` to `total_steps`.

    `next_step()` returns the accumulation_steps micro-batches of the next optimizer step and the
    sample ids they hold; `data_wait_s` accumulates the time spent waiting on the pipeline.
    """

    def __init__(self, *, data_dir: str, train_ids: np.ndarray, seed: int, global_batch_size: int,
                 micro_batch_size: int, world_size: int, rank: int, start_step: int, total_steps: int,
                 steps_per_epoch: int, device: torch.device, prefetch_batches: int = 4, reader_cpus: float = 0.0):
        self.order = RankOrder(np.asarray(train_ids, dtype=np.int64), seed, steps_per_epoch, global_batch_size,
                               world_size, rank, start_step)
        self.num_positions = max(0, total_steps - start_step) * (global_batch_size // world_size)
        self.data_dir, self.m, self.device = data_dir, micro_batch_size, device
        self.accumulation_steps = global_batch_size // (micro_batch_size * world_size)
        self.prefetch_batches, self.reader_cpus = prefetch_batches, reader_cpus
        self.step = start_step
        self._batches = None
        self.data_wait_s = 0.0

    def _start(self):
        ds = rank_dataset(self.order, self.num_positions, self.data_dir, self.m, self.reader_cpus)
        # On CUDA, batches are collated into pinned host memory and Ray Data's prefetch thread copies
        # them to the GPU with non_blocking=True (its default), so the copy overlaps the running step.
        # On CPU there is no copy and nothing to pin.
        return iter(ds.iter_torch_batches(batch_size=self.m, prefetch_batches=self.prefetch_batches,
                                          dtypes={"input_ids": torch.long, "sample_id": torch.long},
                                          device=self.device, drop_last=False,
                                          pin_memory=torch.device(self.device).type == "cuda"))

    def next_step(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        t0 = time.perf_counter()
        if self._batches is None:
            self._batches = self._start()
        batches = [next(self._batches) for _ in range(self.accumulation_steps)]
        self.data_wait_s += time.perf_counter() - t0
        self.step += 1
        return [b["input_ids"] for b in batches], torch.cat([b["sample_id"].cpu() for b in batches])
