"""Each worker's stream of micro-batches, through Ray Data, from any resume point.

Ray Data has no resumable iterator (ray-project/ray#37633, #48224) and `streaming_split` does not promise
which rank gets which rows, so the order is ours (`minilm.data.RankOrder`) and Ray Data only streams: the
positions of what this rank consumes from its resume step to the last (`ray.data.range`), turned into rows by
read tasks on the rank's own node (`SequenceStore` over the node's copy of the token files), prefetched
while the step runs. Restarting at any step and world size is the same pipeline from another first step.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import ray

from minilm import data as D

if TYPE_CHECKING:
    import torch

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


class RankStream:
    """Each optimizer step's micro-batches on `device` and their sample ids, from `order.start_step` to
    `total_steps`; `data_wait_s` is the time spent waiting on the pipeline."""

    def __init__(self, data_dir: str, order: D.RankOrder, total_steps: int, micro_batch_size: int,
                 device: torch.device | str):
        import torch  # here, not at the top: the read tasks import this module and need no torch

        self.data_dir, self.order, self.m, self.device = str(data_dir), order, micro_batch_size, torch.device(device)
        self.num_steps = max(0, total_steps - order.start_step)
        self._batches = None
        self.data_wait_s = 0.0

    def __iter__(self):
        for _ in range(self.num_steps):
            yield self.next_step()

    def _start(self):
        ds = rank_dataset(self.order, self.num_steps * self.order.per_rank, self.data_dir, self.m,
                          node_id=ray.get_runtime_context().get_node_id())
        # One batch per optimizer step, numpy: the sample ids stay on the host, the rows are copied to the device here.
        return iter(ds.iter_batches(batch_size=self.order.per_rank, prefetch_batches=PREFETCH_BATCHES, batch_format="numpy",
                                    drop_last=False))

    def next_step(self) -> tuple[list[torch.Tensor], np.ndarray]:
        t0 = time.perf_counter()
        if self._batches is None:
            self._batches = self._start()
        batch = next(self._batches)
        self.data_wait_s += time.perf_counter() - t0
        rows = batch["input_ids"]
        return [self._to_device(rows[i:i + self.m]) for i in range(0, len(rows), self.m)], batch["sample_id"]

    def _to_device(self, rows: np.ndarray) -> torch.Tensor:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(rows))
        if self.device.type == "cuda":
            t = t.pin_memory()  # so the copy is async
        return t.to(self.device, non_blocking=True).long()
