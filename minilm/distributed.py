"""Collectives of the training loop, in one place, and stop flags agreed by every rank without stalling a step.
Every collective runs on the training device: NCCL has no backend for CPU tensors (tests/test_nccl_rules.py)."""

from __future__ import annotations

import gc
import os
import time
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist

# Stop flags raised by the end of optimizer step s are acted on, by every rank, at the end of step
# s + AGREEMENT_DELAY: their all-reduce runs in the background meanwhile, so no step waits on it.
AGREEMENT_DELAY = 2


class Collectives:
    """The loop's collectives on `device`, the training device (identity when not distributed)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def all_reduce(self, tensor: torch.Tensor, op=None, async_op: bool = False):
        """All-reduce `tensor` (moved to the training device first); returns (tensor, work or None)."""
        tensor = tensor.to(self.device)
        if self.world_size == 1:
            return tensor, None
        return tensor, dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, async_op=async_op)

    def broadcast_from_rank0(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone().to(self.device)
        if self.world_size > 1:
            dist.broadcast(tensor, src=0)
        return tensor

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(tensor.clone())[0]


class FlagAgreement:
    """Boolean flags OR-ed over every rank each optimizer step by an asynchronous all-reduce, read `delay` steps later
    (`push` returns step `step - delay`'s); on CUDA through pinned memory behind an event, so nothing waits."""

    def __init__(self, collectives: Collectives, names: tuple[str, ...], delay: int = AGREEMENT_DELAY):
        self.c, self.names, self.delay = collectives, names, delay
        self.cuda = collectives.device.type == "cuda"
        # (flags, what completes them): CUDA, a pinned host copy and its event; else the device flags and the
        # all-reduce's work (None when not distributed)
        self.pending: deque[tuple[torch.Tensor, object | None]] = deque()

    def push(self, step: int, host_flags: list[bool], device_flags: list[torch.Tensor] = ()) -> list[str]:
        host = torch.tensor([float(bool(f)) for f in host_flags], dtype=torch.float32, device="cpu")
        if self.cuda:
            host = host.pin_memory()
        flags = host.to(self.c.device, non_blocking=True)
        if device_flags:
            flags = torch.cat([flags, torch.stack([f.reshape(()).float() for f in device_flags])])
        flags, work = self.c.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        if self.cuda:
            if work is not None:
                work.wait()  # NCCL: the current stream waits for the all-reduce; the host does not
            host_copy = torch.empty(flags.shape, dtype=flags.dtype, device="cpu", pin_memory=True)
            host_copy.copy_(flags, non_blocking=True)
            flags, work = host_copy, torch.cuda.Event()  # read on the host once this event completes
            work.record()
        self.pending.append((flags, work))
        if len(self.pending) <= self.delay:
            return []
        return self._read(*self.pending.popleft())

    def _read(self, flags: torch.Tensor, done) -> list[str]:
        if self.cuda:
            done.synchronize()
        elif done is not None:
            done.wait()
        return [name for name, v in zip(self.names, flags.tolist(), strict=True) if v > 0]

    def drain(self) -> list[str]:
        """Wait for every pending all-reduce (before the process group goes away); the union of their flags."""
        reasons: list[str] = []
        while self.pending:
            reasons += [r for r in self._read(*self.pending.popleft()) if r not in reasons]
        return reasons


# How long a rank waits in one collective before the run fails (--collective-timeout-s): longer than any legitimate
# wait (rank 0 writing a checkpoint, a first step that compiles). NCCL's and gloo's own defaults.
COLLECTIVE_TIMEOUT_S = {"cuda": 600.0, "cpu": 1800.0}


def collective_timeout_s(device_type: str, given: float | None = None) -> float:
    """--collective-timeout-s, or the default for the training device."""
    return float(given) if given is not None else COLLECTIVE_TIMEOUT_S.get(device_type, COLLECTIVE_TIMEOUT_S["cpu"])


def collective_failure(e: BaseException, timeout_s: float, rank: int, world_size: int) -> str | None:
    """One line for a collective that timed out or lost a peer (a rank hangs, straggles or died), None for any
    other error. gloo's error names no rank; with two ranks the one that did not answer is the other."""
    if not (type(e) is RuntimeError or isinstance(e, dist.DistError)):  # minilm's own errors are subclasses
        return None
    text = str(e)
    low = text.lower()
    other = f"rank {1 - rank}" if world_size == 2 else "another rank"
    if "timed out" in low or "timeout" in low:
        what = (f"a collective on rank {rank} timed out after {timeout_s:g} s (--collective-timeout-s): {other} did "
                f"not answer (hung, straggling or gone)")
    elif any(k in low for k in ("connection closed by peer", "connection reset", "pair closure", "broken pipe")):
        what = f"rank {rank} lost its connection to {other} in a collective (that rank stopped answering or died)"
    else:
        return None
    detail = text.strip().splitlines()[-1].split("] ", 1)[-1][:160] if text.strip() else type(e).__name__
    return f"{what} [{detail}]; the checkpoints written so far are intact: continue with --resume auto"


class CollectiveError(RuntimeError):
    """A collective timed out or lost a peer; the message is `collective_failure`'s line."""


def init_from_torchrun(backend: str | None = None, timeout_s: float | None = None) -> tuple[int, int, torch.device]:
    """Join torchrun's process group (NCCL on CUDA, one GPU per local rank; gloo on CPU): (rank, world size, device).
    Without torchrun: (0, 1, cuda:0 or cpu)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rank, world_size, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), \
        int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"),
                                timeout=timedelta(seconds=collective_timeout_s(device.type, timeout_s)))
    return rank, world_size, device


def leave_process_group() -> None:
    """Destroy the process group at the end of a run, after collecting the trainer's cycles (DDP holds the group) and
    releasing the GIL for 50 ms: a gloo thread still dropping tensors at exit would abort the process."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    time.sleep(0.05)
    dist.destroy_process_group()
