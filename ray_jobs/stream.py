"""Each worker's stream of micro-batches, through Ray Data, from any resume point.

Ray Data has no resumable iterator (ray-project/ray#37633, #48224), and `streaming_split` does not
promise which rank gets which rows. So the order is ours (`minilm.data`: a pure function of seed,
epoch, optimizer step, rank and world size) and Ray Data does the streaming. Each worker streams
one dataset for the rest of the run: the positions 0, 1, 2, ... of what this rank will consume
from its resume step to the last step (`ray.data.range`, lazy, no id array held anywhere); a
`map_batches` actor, placed on the worker's own node, turns positions into sample ids
(`minilm.data.RankOrder`) and reads those rows from the node's token files (`SequenceStore`:
positional reads through the page cache every process of the node shares; a remote `--data` is
copied to the node once, by `minilm.data.open_local`); `iter_batches` prefetches them while the
step runs. Epoch boundaries are just positions, so no pipeline starts mid-run; restarting at any
step, at any world size, is building the same pipeline from a different first step.
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


class ReadSequences:
    """Ray Data callable class: stream positions in, sample ids and packed rows out.

    `order` is a `RankOrder`, or its recipe without the training ids (`order_recipe`): the actor then makes
    the ids itself from the data and `val_samples` (`minilm.data.split_ids`), so its constructor
    arguments stay a few bytes. A large argument would go through the object store, which Ray warns
    about for restartable actors (ray-project/ray#53727), and cost a copy per rank."""

    def __init__(self, data: str, order: D.RankOrder | dict):
        prepared = D.open_local(data)
        self.store = D.SequenceStore(prepared)
        if isinstance(order, dict):
            train_ids, _ = D.split_ids(prepared.num_sequences, order.pop("val_samples"))
            order = D.RankOrder(compact_ids(train_ids), **order)
        self.order = order

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = self.order.sample_ids(batch["id"])
        return {"sample_id": ids, "input_ids": self.store.take(ids)}


def order_recipe(order: D.RankOrder, val_samples: int) -> dict:
    """What ReadSequences needs to rebuild `order` (whose training ids are split_ids(N, val_samples)[0])."""
    return {"val_samples": val_samples, "seed": order.seed, "steps_per_epoch": order.steps_per_epoch,
            "global_batch_size": order.global_batch_size, "world_size": order.world_size, "rank": order.rank,
            "start_step": order.start_step}


def rank_dataset(order: D.RankOrder | dict, num_positions: int, data: str, micro_batch_size: int,
                 node_id: str | None = None):
    """The rank's Ray Data pipeline; its reader actor runs on `node_id` (the rank's node) when given."""
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the order is the resume contract
    ctx.enable_progress_bars = False  # one pipeline per worker: bars would drown the log line
    ctx.print_on_execution_start = False
    # Ray labels every node with its id (ray.io/node-id); a label selector is a hard constraint. (The older
    # scheduling_strategy=NodeAffinitySchedulingStrategy goes through ray_remote_args, deprecated in Ray 2.60.)
    on_node = None if node_id is None else {NODE_ID_LABEL: node_id}
    # One read task at a time: the positions are trivial to make, and each concurrent task starts a worker process.
    # The reader reserves no CPU, so it never waits for one the training workers hold.
    return ray.data.range(num_positions, concurrency=1).map_batches(
        ReadSequences, fn_constructor_args=(data, order), batch_size=micro_batch_size, batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=1), num_cpus=0, label_selector=on_node)


def compact_ids(ids: np.ndarray) -> np.ndarray:
    """Sample ids as int32 when they fit: the reader's copy of the order (ids and two epoch permutations)
    then takes 4 bytes a sample, not 8. The values, and so the order, are the same."""
    ids = np.asarray(ids)
    return ids.astype(np.int32) if len(ids) == 0 or int(ids.max()) < 2**31 else ids.astype(np.int64)


class RankStream:
    """Micro-batches for one rank from optimizer step `start_step` to `total_steps`.

    `data_dir` is a prepared folder or a remote URI. `next_step()` returns the accumulation_steps
    micro-batches of the next optimizer step and the sample ids they hold; `data_wait_s`
    accumulates the time spent waiting on the pipeline.
    """

    def __init__(self, *, data_dir: str, train_ids: np.ndarray, seed: int, global_batch_size: int,
                 micro_batch_size: int, world_size: int, rank: int, start_step: int, total_steps: int,
                 steps_per_epoch: int, device: torch.device, prefetch_batches: int = 4,
                 val_samples: int | None = None):
        """`val_samples`: the training ids are `split_ids(N, val_samples)[0]` (the trainer's): the reader rebuilds
        them instead of receiving the array."""
        self.order = D.RankOrder(compact_ids(train_ids), seed, steps_per_epoch, global_batch_size, world_size, rank,
                                 start_step)
        self.val_samples = val_samples
        self.num_positions = max(0, total_steps - start_step) * (global_batch_size // world_size)
        import torch  # here, not at the top: the reader actor imports this module and needs no torch

        self.data_dir, self.m, self.device = str(data_dir), micro_batch_size, torch.device(device)
        self.accumulation_steps = global_batch_size // (micro_batch_size * world_size)
        self.prefetch_batches = prefetch_batches
        self.step = start_step
        self._batches = None
        self.data_wait_s = 0.0

    def _start(self):
        order = self.order if self.val_samples is None else order_recipe(self.order, self.val_samples)
        ds = rank_dataset(order, self.num_positions, self.data_dir, self.m,
                          node_id=ray.get_runtime_context().get_node_id())
        # Numpy batches: the sample ids stay on the host (they are only recorded, never computed on), and
        # the token rows are copied to the device here, from pinned memory on CUDA so the copy is async.
        return iter(ds.iter_batches(batch_size=self.m, prefetch_batches=self.prefetch_batches, batch_format="numpy",
                                    drop_last=False))

    def next_step(self) -> tuple[list[torch.Tensor], np.ndarray]:
        t0 = time.perf_counter()
        if self._batches is None:
            self._batches = self._start()
        batches = [next(self._batches) for _ in range(self.accumulation_steps)]
        self.data_wait_s += time.perf_counter() - t0
        self.step += 1
        return [self._to_device(b["input_ids"]) for b in batches], np.concatenate([b["sample_id"] for b in batches])

    def _to_device(self, rows: np.ndarray) -> torch.Tensor:
        import torch

        t = torch.from_numpy(np.ascontiguousarray(rows))
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True).long()
