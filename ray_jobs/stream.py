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
from concurrent.futures import Future, ThreadPoolExecutor

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
    sample ids they hold; `data_wait_s` accumulates the time spent waiting on the pipeline. The
    next epoch's pipeline starts in the background during the last steps of the current one, so
    an epoch boundary costs no pipeline start-up.
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
        self._current: Iterator | None = None
        self._next: Future | None = None  # the next epoch's (iterator, first batch), being started
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="next-epoch")
        self.data_wait_s = 0.0

    def _start_epoch_at(self, step: int) -> tuple[Iterator, dict]:
        pos = D.DataPosition.at(step, self.steps_per_epoch, self.G)
        order = D.epoch_order(self.train_ids, self.seed, pos.epoch)
        ids = D.rank_sample_ids(order, pos.step_in_epoch, self.steps_per_epoch, self.G, self.W, self.rank)
        ds = sample_id_dataset(ids, self.data_dir, self.m, self.reader_cpus)
        # On CUDA, batches are collated into pinned host memory and Ray Data's prefetch thread copies
        # them to the GPU with non_blocking=True (its default), so the copy overlaps the running step.
        # On CPU there is no copy and nothing to pin.
        it = iter(ds.iter_torch_batches(batch_size=self.m, prefetch_batches=self.prefetch_batches,
                                        dtypes={"input_ids": torch.long, "sample_id": torch.long},
                                        device=self.device, drop_last=False,
                                        pin_memory=torch.device(self.device).type == "cuda"))
        return it, next(it)

    def _batches(self, n: int) -> list[dict]:
        if self.step % self.steps_per_epoch == 0 or self._current is None:  # a new epoch (or a restart)
            if self._next is not None:
                self._current, first = self._next.result()
                self._next = None
            else:
                self._current, first = self._start_epoch_at(self.step)
            return [first] + [next(self._current) for _ in range(n - 1)]
        return [next(self._current) for _ in range(n)]

    def next_step(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        t0 = time.perf_counter()
        batches = self._batches(self.accumulation_steps)
        self.data_wait_s += time.perf_counter() - t0
        self.step += 1
        left_in_epoch = self.steps_per_epoch - self.step % self.steps_per_epoch
        if left_in_epoch == min(2, self.steps_per_epoch) and self._next is None:
            next_epoch_start = self.step + left_in_epoch
            self._next = self._pool.submit(self._start_epoch_at, next_epoch_start)
        return [b["input_ids"] for b in batches], torch.cat([b["sample_id"].cpu() for b in batches])
