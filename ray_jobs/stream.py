"""Each worker's stream of micro-batches, through Ray Data, from any resume point. Ray Data has no resumable
iterator and `streaming_split` does not promise which rank gets which rows, so the order is ours (`RankOrder`):
Ray Data only streams the positions this rank consumes, turned into rows by read tasks on the rank's node."""

from __future__ import annotations

import time

import numpy as np
import ray

from minilm import data as D

NODE_ID_LABEL = "ray.io/node-id"
PREFETCH_BATCHES = 4  # optimizer steps read ahead while the step runs
_STORES: dict[str, D.SequenceStore] = {}  # a reader process's open stores: Ray reuses it for the next tasks


def read_sequences(batch: dict[str, np.ndarray], data: str, order: D.RankOrder) -> dict[str, np.ndarray]:
    """Ray Data batch function: stream positions in, sample ids and packed rows out. `order` pickles without its
    training ids, so each task's arguments stay small (ray-project/ray#53727)."""
    if data not in _STORES:
        _STORES[data] = D.SequenceStore(D.open_local(data))
    ids = order.sample_ids(batch["id"])
    return {"sample_id": ids, "input_ids": _STORES[data].take(ids)}


def rank_dataset(order: D.RankOrder, num_positions: int, data: str, micro_batch_size: int, node_id: str):
    """The rank's Ray Data pipeline; its read tasks run on `node_id` (the rank's node)."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the order is the resume contract
    ctx.enable_progress_bars = False  # one pipeline per worker: bars would drown the log line
    ctx.print_on_execution_start = False
    # A label selector is a hard constraint (NodeAffinitySchedulingStrategy is deprecated in Ray 2.60).
    # One read task at a time, the range and the reading fused in it: a restart reuses the worker process of the
    # tasks before (an actor reader was a new process each time, ~1-5 s); it reserves no CPU the training needs.
    return ray.data.range(num_positions, concurrency=1).map_batches(
        read_sequences, fn_args=(data, order), batch_size=micro_batch_size, batch_format="numpy", concurrency=1,
        num_cpus=0, label_selector={NODE_ID_LABEL: node_id})


class RankStream(D.LocalRankStream):
    """`LocalRankStream` with its rows read by the Ray Data pipeline; `data_wait_s` is the time spent waiting on it."""

    def __init__(self, data_dir: str, order: D.RankOrder, total_steps: int, micro_batch_size: int, device):
        super().__init__(None, order, total_steps, micro_batch_size, device)
        self.data_dir, self._batches = str(data_dir), None

    def next_step(self) -> tuple[list, np.ndarray]:
        t0 = time.perf_counter()
        if self._batches is None:
            ds = rank_dataset(self.order, self.num_steps * self.order.per_rank, self.data_dir, self.m,
                              node_id=ray.get_runtime_context().get_node_id())
            # One batch per optimizer step, numpy: the sample ids stay on the host, the rows go to the device here.
            self._batches = iter(ds.iter_batches(batch_size=self.order.per_rank, prefetch_batches=PREFETCH_BATCHES,
                                                 batch_format="numpy", drop_last=False))
        batch = next(self._batches)
        self.data_wait_s += time.perf_counter() - t0
        return self.micro_batches(batch["input_ids"]), batch["sample_id"]
