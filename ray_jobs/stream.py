"""Each worker's stream of micro-batches, through Ray Data, from any resume point. Ray Data has no resumable
iterator and `streaming_split` does not promise which rank gets which rows, so the order is ours (`RankOrder`):
Ray Data only streams the positions this rank consumes, turned into rows by a reader actor on the rank's node."""

from __future__ import annotations

import time

import numpy as np
import ray

from minilm import data as D

NODE_ID_LABEL = "ray.io/node-id"
PREFETCH_BATCHES = 4  # optimizer steps read ahead while the step runs


class ReadSequences:
    """Ray Data callable class: stream positions in, sample ids and packed rows out. `order` pickles without its
    training ids, so the actor's arguments stay small (ray-project/ray#53727)."""

    def __init__(self, data: str, order: D.RankOrder):
        self.store = D.SequenceStore(D.open_local(data))
        self.order = order

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = self.order.sample_ids(batch["id"])
        return {"sample_id": ids, "input_ids": self.store.take(ids)}


def rank_dataset(order: D.RankOrder, num_positions: int, data: str, micro_batch_size: int, node_id: str):
    """The rank's Ray Data pipeline; its reader actor runs on `node_id` (the rank's node)."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the order is the resume contract
    ctx.enable_progress_bars = False  # one pipeline per worker: bars would drown the log line
    ctx.print_on_execution_start = False
    # A label selector is a hard constraint (NodeAffinitySchedulingStrategy is deprecated in Ray 2.60).
    # One read task at a time (each starts a worker process); the reader reserves no CPU the training workers need.
    return ray.data.range(num_positions, concurrency=1).map_batches(
        ReadSequences, fn_constructor_args=(data, order), batch_size=micro_batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0, label_selector={NODE_ID_LABEL: node_id})


class RankStream(D.LocalRankStream):
    """`LocalRankStream` with its rows read by the Ray Data pipeline; `data_wait_s` is the time spent waiting on it."""

    def __init__(self, data_dir: str, order: D.RankOrder, total_steps: int, micro_batch_size: int, device):
        super().__init__(None, order, total_steps, micro_batch_size, device)
        self.data_dir, self._batches = str(data_dir), None

    def _start(self):
        ds = rank_dataset(self.order, self.num_steps * self.order.per_rank, self.data_dir, self.m,
                          node_id=ray.get_runtime_context().get_node_id())
        # One batch per optimizer step, numpy: the sample ids stay on the host, the rows are copied to the device here.
        return iter(ds.iter_batches(batch_size=self.order.per_rank, prefetch_batches=PREFETCH_BATCHES, batch_format="numpy",
                                    drop_last=False))

    def next_step(self) -> tuple[list, np.ndarray]:
        t0 = time.perf_counter()
        if self._batches is None:
            self._batches = self._start()
        batch = next(self._batches)
        self.data_wait_s += time.perf_counter() - t0
        return self.micro_batches(batch["input_ids"]), batch["sample_id"]
