"""Each worker's stream of micro-batches, through Ray Data, from any resume point.

Ray Data has no resumable iterator (ray-project/ray#37633, #48224), and `streaming_split` does not
promise which rank gets which rows. So the order is ours (`minilm.data`: a pure function of seed,
epoch, optimizer step, rank and world size) and Ray Data does the streaming: each worker turns the
sample ids it will consume from the resume step to the end of the epoch into a dataset,
`map_batches` reads those rows from the parquet shards in a Ray Data actor, and
`iter_torch_batches` prefetches them while the step runs. Restarting at any step, at any world
size, is building the same pipeline from a different first step.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import ray
import torch

from minilm import data as D


class ReadSequences:
    """Ray Data callable class: sample ids in, packed rows out (shards cached in the actor)."""

    def __init__(self, data_dir: str):
        self.store = D.SequenceStore(D.open_prepared(data_dir))

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["sample_id"]
        return {"sample_id": ids, "input_ids": self.store.take(ids)}


def sample_id_dataset(ids: np.ndarray, data_dir: str, micro_batch_size: int, reader_cpus: float):
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the order is the resume contract
    ctx.enable_progress_bars = False  # one pipeline per worker and epoch: bars would drown the log line
    ctx.print_on_execution_start = False
    ds = ray.data.from_numpy(np.ascontiguousarray(ids)).rename_columns({"data": "sample_id"})
    return ds.map_batches(ReadSequences, fn_constructor_args=(data_dir,), batch_size=micro_batch_size,
                          batch_format="numpy", compute=ray.data.ActorPoolStrategy(size=1), num_cpus=reader_cpus)


class RankStream:
    """Micro-batches for one rank, epoch after epoch, starting at a given optimizer step.

    `next_step()` returns the accumulation_steps micro-batches of the next optimizer step and the
    sample ids they hold; `data_wait_s` accumulates the time spent waiting on the pipeline.
    """

    def __init__(self, *, data_dir: str, train_ids: np.ndarray, seed: int, global_batch_size: int,
                 micro_batch_size: int, world_size: int, rank: int, start_step: int, steps_per_epoch: int,
                 device: torch.device, prefetch_batches: int = 4, reader_cpus: float = 0.0):
        self.data_dir, self.train_ids, self.seed = data_dir, train_ids, seed
        self.G, self.m, self.W, self.rank = global_batch_size, micro_batch_size, world_size, rank
        self.steps_per_epoch, self.device = steps_per_epoch, device
        self.accumulation_steps = global_batch_size // (micro_batch_size * world_size)
        self.prefetch_batches, self.reader_cpus = prefetch_batches, reader_cpus
        self.step = start_step
        self._iter: Iterator | None = None
        self.data_wait_s = 0.0

    def _open_epoch(self) -> None:
        pos = D.DataPosition.at(self.step, self.steps_per_epoch, self.G)
        order = D.epoch_order(self.train_ids, self.seed, pos.epoch)
        ids = D.rank_sample_ids(order, pos.step_in_epoch, self.steps_per_epoch, self.G, self.W, self.rank)
        ds = sample_id_dataset(ids, self.data_dir, self.m, self.reader_cpus)
        self._iter = iter(ds.iter_torch_batches(batch_size=self.m, prefetch_batches=self.prefetch_batches,
                                                dtypes={"input_ids": torch.long, "sample_id": torch.long},
                                                device=self.device, drop_last=False))
        self._left_in_epoch = self.steps_per_epoch - pos.step_in_epoch

    def next_step(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        if self._iter is None or self._left_in_epoch == 0:
            self._open_epoch()
        t0 = time.perf_counter()
        batches = [next(self._iter) for _ in range(self.accumulation_steps)]
        self.data_wait_s += time.perf_counter() - t0
        self.step += 1
        self._left_in_epoch -= 1
        return [b["input_ids"] for b in batches], torch.cat([b["sample_id"].cpu() for b in batches])
