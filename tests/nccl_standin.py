"""A stand-in for NCCL's rules on a CPU machine, for the tests of the training loop's collectives.

NCCL accepts only CUDA tensors: on a GPU run, a collective given a tensor made on the CPU (a control flag,
a metric) fails with "No backend type associated with device type cpu". gloo on CPU accepts anything, so
CPU tests never see that class of bug. Inside `NcclRules(device)`:

* every collective of `torch.distributed` the code calls (all_reduce, broadcast, all_gather, ...) refuses
  a tensor that is not on `device`, the training device the loop declared, as NCCL refuses one that is
  not on the GPU;
* the default device for new tensors is `meta`, so a tensor made without naming a device (on a GPU run:
  a CPU tensor) is off the training device, and a collective on it is refused;
* each collective is recorded (op, dtype, shape), so a test can check that every rank issued the same
  collectives in the same order (NCCL would hang otherwise), and DDP's per-forward buffer broadcasts
  (`torch.distributed._broadcast_coalesced`) are counted.

DDP's own gradient all-reduce runs in C++ on the gradients, which live on the training device by
construction; it is outside what this stand-in sees. A tensor made *explicitly* on the CPU and handed to
a collective is outside it too when the training device is the CPU: the stand-in cannot tell it apart.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
       "gather", "scatter", "all_to_all_single")


class NcclViolation(AssertionError):
    pass


class NcclRules:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.calls: list[tuple[str, str, tuple]] = []
        self.buffer_broadcasts = 0

    def _check(self, op: str, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device != self.device:
                raise NcclViolation(f"NCCL refuses this {op}: a tensor on {t.device}, the training device is "
                                    f"{self.device} ('No backend type associated with device type {t.device.type}')")

    def _wrap(self, op: str, real):
        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            self._check(op, tensors)
            self.calls.append((op, str(tensors[0].dtype) if tensors else "", tuple(tensors[0].shape) if tensors else ()))
            return real(*args, **kwargs)
        return collective

    def __enter__(self) -> NcclRules:
        self.saved = {op: getattr(dist, op) for op in OPS}
        self.saved["_broadcast_coalesced"] = dist._broadcast_coalesced
        for op in OPS:
            setattr(dist, op, self._wrap(op, self.saved[op]))

        def broadcast_coalesced(*args, **kwargs):
            self.buffer_broadcasts += 1
            return self.saved["_broadcast_coalesced"](*args, **kwargs)

        dist._broadcast_coalesced = broadcast_coalesced
        self.default_device = torch.get_default_device()
        torch.set_default_device("meta")
        return self

    def __exit__(self, *exc) -> None:
        torch.set_default_device(self.default_device)
        for op, f in self.saved.items():
            setattr(dist, op, f)
