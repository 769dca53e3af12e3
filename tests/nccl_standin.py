"""A stand-in for NCCL's rules on a CPU machine, for the tests of the training loop's collectives.

NCCL accepts only CUDA tensors: on a GPU run, a collective given a tensor made on the CPU (a control flag,
a metric) fails with "No backend type associated with device type cpu". gloo on CPU accepts anything, and
on a CPU run the CPU *is* the training device, so CPU tests never see that class of bug. Inside
`NcclRules()`:

* the training device is the stand-in's own (`NcclRules.device`): a tensor on it is an `OnDevice`, a
  wrapper whose data lives in a CPU tensor, made by `.to(device)` or a factory given `device=` (a
  `TorchDispatchMode` runs every op on the wrapped CPU data and wraps the result again). Any other tensor
  is on the host, as on a GPU run: one made without naming a device, with `device="cpu"`, by `.cpu()`
  or `torch.from_numpy`;
* every collective of `torch.distributed` the code calls (all_reduce, broadcast, all_gather, ...) refuses
  a tensor that is not on the training device, as NCCL refuses one that is not on the GPU; on the device
  it runs gloo on the wrapped data;
* an op mixing the device and a host tensor of one or more dimensions fails, as it does on a GPU
  (0-dim host tensors pass, as CUDA lets CPU scalars through);
* each collective is recorded (op, dtype, shape), so a test can check that every rank issued the same
  collectives in the same order (NCCL would hang otherwise), and DDP's per-forward buffer broadcasts
  (`torch.distributed._broadcast_coalesced`) are counted.

The model, its gradients and DDP stay on the CPU: DDP's gradient all-reduce runs in C++ on the gradients,
which live on the training device by construction, outside what this stand-in sees. A test puts the loop's
own collectives (`minilm.distributed.Collectives`) and the state they reduce (the non-finite guard) on
`NcclRules.device`. The wrapper reports `meta` as its device type (the one non-CPU type this torch build
can place a tensor on without a backend); tell it apart from a real meta tensor by `isinstance`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
       "gather", "scatter", "all_to_all_single")
DEVICE = torch.device("meta")  # the type the wrapper reports; its data is on the CPU


class NcclViolation(AssertionError):
    pass


class OnDevice(torch.Tensor):
    """A tensor on the stand-in's training device, its data in the CPU tensor `elem`."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.shape, strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                device=DEVICE, requires_grad=False)
        t.elem = elem
        return t

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:  # no aten op: read the data (a device-to-host copy on a GPU)
            return args[0].elem.tolist()
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NcclViolation(f"{func} on the stand-in's device outside NcclRules")

    def __repr__(self) -> str:
        return f"OnDevice({self.elem!r})"


def _on_device(target) -> bool:
    return target is not None and torch.device(target).type == DEVICE.type


class _DeviceMode(TorchDispatchMode):
    """Runs every op on the wrapped CPU data; wraps what an op on the device (or a copy to it) returns."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        target = kwargs.get("device")
        to_device = _on_device(target)
        if to_device:
            kwargs["device"] = torch.device("cpu")
        flat, spec = tree_flatten((args, kwargs))
        wrapped = {id(a.elem): a for a in flat if isinstance(a, OnDevice)}
        if wrapped and func is not torch.ops.aten._to_copy.default:
            host = [a for a in flat if isinstance(a, torch.Tensor) and not isinstance(a, OnDevice) and a.dim() > 0]
            if host:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                                   f"the training device and {host[0].device}! ({func})")
        args, kwargs = tree_unflatten([a.elem if isinstance(a, OnDevice) else a for a in flat], spec)
        out = func(*args, **kwargs)
        if not (to_device or (wrapped and not (target is not None and torch.device(target).type == "cpu"))):
            return out
        # an in-place op returns its input: the same wrapper
        return tree_map(lambda t: (wrapped[id(t)] if id(t) in wrapped else OnDevice(t))
                        if isinstance(t, torch.Tensor) else t, out)


class NcclRules:
    device = DEVICE

    def __init__(self):
        self.calls: list[tuple[str, str, tuple]] = []
        self.buffer_broadcasts = 0

    def _check(self, op: str, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and not isinstance(t, OnDevice):
                raise NcclViolation(f"NCCL refuses this {op}: a tensor on {t.device}, not on the training device "
                                    f"('No backend type associated with device type {t.device.type}')")

    def _wrap(self, op: str, real):
        def collective(*args, **kwargs):
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            self._check(op, tensors)
            self.calls.append((op, str(tensors[0].dtype) if tensors else "", tuple(tensors[0].shape) if tensors else ()))
            args, kwargs = tree_map(lambda t: t.elem if isinstance(t, OnDevice) else t, (args, kwargs))
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
        self.mode = _DeviceMode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.mode.__exit__(*exc)
        for op, f in self.saved.items():
            setattr(dist, op, f)
