"""Reading rows by sample id: from the token files (`SequenceStore`) or from memory, and one rank's
stream of them in this process (`LocalRankStream`)."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from contextlib import suppress

import numpy as np

from .format import DataError, PreparedData
from .order import RankOrder

MAX_OPEN_SHARDS = 256  # file descriptors a SequenceStore keeps open (least recently used are closed)


class SequenceStore:
    """Rows by sample id, read with positional reads (adjacent rows in one), readahead off; nothing is cached here:
    the page cache, shared by the node's processes, is."""

    def __init__(self, data: PreparedData):
        self.data = data
        self._paths = data.shard_paths
        self._starts = np.array([int(s["first_sample_id"]) for s in data.manifest["shards"]], dtype=np.int64)
        self._dtype = data.token_dtype
        self._row_len = data.seq_len + 1
        self._row_bytes = self._row_len * self._dtype.itemsize
        self._fds: OrderedDict[int, int] = OrderedDict()

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        try:
            fd = os.open(self._paths[shard], os.O_RDONLY)
        except FileNotFoundError:
            raise DataError(f"{self._paths[shard]}: token file is missing (it was there when the data was "
                            f"opened)") from None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._fds[shard] = fd
        if len(self._fds) > MAX_OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _read(self, shard: int, first_row: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        offset, done = first_row * self._row_bytes, 0
        while done < len(view):
            n = os.preadv(self._fd(shard), [view[done:]], offset + done)
            if n == 0:
                raise DataError(f"{self._paths[shard]}: ends before row {first_row + len(out)} (truncated since "
                                f"the data was opened)")
            done += n

    def take(self, sample_ids: np.ndarray) -> np.ndarray:
        """Rows for `sample_ids`, in that order: (len(sample_ids), seq_len + 1) int32."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        if len(sample_ids) and (sample_ids.min() < 0 or sample_ids.max() >= self.data.num_sequences):
            raise DataError(f"{self.data.location}: sample ids must be in [0, {self.data.num_sequences}), got "
                            f"{sample_ids.min()}..{sample_ids.max()}")
        raw = np.empty((len(sample_ids), self._row_len), dtype=self._dtype)
        if len(sample_ids):
            order = np.argsort(sample_ids, kind="stable")
            ids = sample_ids[order]
            shard = np.searchsorted(self._starts, ids, side="right") - 1
            # runs of consecutive ids in one shard are read with one call
            cuts = np.flatnonzero((np.diff(ids) != 1) | (np.diff(shard) != 0)) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(ids)], strict=True):
                dst = order[a:b]
                row = int(ids[a] - self._starts[shard[a]])
                if dst[-1] - dst[0] == b - a - 1 and (b - a == 1 or np.all(np.diff(dst) == 1)):
                    self._read(int(shard[a]), row, raw[dst[0]:dst[0] + b - a])  # already in place
                else:
                    rows = np.empty((b - a, self._row_len), dtype=self._dtype)
                    self._read(int(shard[a]), row, rows)
                    raw[dst] = rows
        return raw.astype(np.int32)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __del__(self):
        with suppress(Exception):
            self.close()

    def __getstate__(self):  # a store sent to another process opens its own files there
        return {k: v for k, v in self.__dict__.items() if k != "_fds"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fds = OrderedDict()


class LocalRankStream:
    """One rank's stream read in this process (`ray_jobs.stream.RankStream` reads it through Ray Data): per optimizer
    step, its micro-batches on `device` and their host sample ids; `data_wait_s` is the time spent reading."""

    def __init__(self, store, order: RankOrder, total_steps: int, micro_batch_size: int, device="cpu"):
        import torch

        self.store, self.order, self.m, self.device = store, order, micro_batch_size, torch.device(device)
        self.num_steps = max(0, total_steps - order.start_step)
        self.position = 0
        self.data_wait_s = 0.0

    def __iter__(self):
        for _ in range(self.num_steps):
            yield self.next_step()

    def next_step(self):
        t0 = time.perf_counter()
        ids = self.order.sample_ids(np.arange(self.position, self.position + self.order.per_rank))
        self.position += self.order.per_rank
        batches = self.micro_batches(self.store.take(ids))
        self.data_wait_s += time.perf_counter() - t0
        return batches, ids

    def micro_batches(self, rows: np.ndarray) -> list:
        """A step's rows as micro-batches of at most `m` on the device."""
        import torch

        rows = torch.from_numpy(np.ascontiguousarray(rows))
        if self.device.type == "cuda":  # a non-blocking copy from pageable memory is a synchronous one
            rows = rows.pin_memory()
        return [chunk.to(self.device, non_blocking=True).long() for chunk in rows.split(self.m)]


class RowsInMemory:
    """Rows held in memory, read by sample id like a `SequenceStore` (tests, benchmarks, `--tokens`)."""

    def __init__(self, rows):
        self.rows = np.asarray(rows)

    def take(self, sample_ids: np.ndarray) -> np.ndarray:
        return self.rows[np.asarray(sample_ids, dtype=np.int64)]
