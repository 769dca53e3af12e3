"""A stand-in for the CUDA rules a CPU run never meets, so that code written for one GPU (`--device cuda`: the GPU
check's parts, the Trainer, DDP) runs on a CPU machine the way it runs there, and fails where it would fail there.
Inside `CudaRules()`:

* `torch.cuda` reports one device ("NVIDIA H200", compute capability 9.0). `torch.cuda.set_device` runs
  torch's own code up to the driver call, so a device without an index (`torch.device("cuda")`) raises the
  ValueError a GPU run raises ("Expected a torch.device with a specified index or an integer");
* a tensor placed on "cuda" (`.to(device)`, a factory given `device=`) is made on the CPU and remembered as on the
  device (by its storage), and so is every result of an op on one; a copy to the CPU is on the host;
* NCCL: a process group asked for "nccl" runs gloo, and each collective of `torch.distributed` refuses a tensor
  that is not on the device, as NCCL does ("No backend type associated with device type cpu");
* pinned memory: a non-blocking copy between the host and the device needs its host side pinned (`pin_memory()`,
  `pin_memory=True`, or the pinned result of a non-blocking `.to("cpu")`): from pageable memory a GPU copies
  synchronously (no overlap), and into pageable memory the host may read the bytes before they land;
* DDP: `device_ids` are checked as DDP checks them on a GPU, then dropped (the module really is on the CPU);
* memory: the bytes of the live storages on the device are counted, with their peak, as
  `torch.cuda.memory_allocated`, `max_memory_allocated` and `reset_peak_memory_stats` report them; with
  `CudaRules(memory_limit=BYTES)` (`get_device_properties(...).total_memory`) an allocation past it raises
  torch.OutOfMemoryError, as the GPU's allocator does. The count is of whole results: an op's own scratch is not;
* `torch.cuda.get_rng_state`/`set_rng_state` are the CPU generator's (a tensor "on the device" draws from it);
* `torch.cuda.Event` and `synchronize` are stand-ins that do nothing.

What it records for a test: `set_devices` (the indices set), `collectives` (op, on the device), `copies` (direction,
non-blocking, host side pinned). `allow` (env CUDA_STANDIN_ALLOW for the runner) names rules only recorded. The tensors keep reporting the CPU as their device: code that branches on a
tensor's `.device` (not on the device it was given) takes the CPU branch here. `python tests/cuda_standin.py -m
MODULE ARGS...` runs a module under the rules (a subprocess per part, as the GPU check runs them).
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import types

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce",
               "gather", "scatter", "all_to_all_single")
CUDA = torch.device("cuda", 0)
DEVICE_GET, IS_CUDA_GET = torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__
NAME = "NVIDIA H200"  # as torch names the real one: minilm.progress lists its data-sheet peak
TOTAL_MEMORY = 143771 * 2**20  # an H200's, as torch reports it


class CudaViolation(AssertionError):
    pass


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass

    def wait(self, stream=None):
        pass

    def query(self):
        return True


class _Placement(TorchFunctionMode):
    """Where tensors go: "cuda" becomes the CPU and the result is remembered as on the device; `pin_memory` makes a
    copy remembered as pinned. (A CPU build of torch cannot place a tensor on "cuda" at all, nor pin memory.)"""

    def __init__(self, rules: CudaRules):
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        r, kwargs = self.rules, dict(kwargs or {})
        if func == DEVICE_GET:  # a device tensor says where it is, so code that follows `t.device` goes there too
            return CUDA if r.on_device(args[0]) else func(*args)
        if func == IS_CUDA_GET:
            return r.on_device(args[0])
        if func in (torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda):
            return self._to(func, args, kwargs)
        if func is torch.Tensor.pin_memory:
            with torch._C.DisableTorchFunction():
                out = args[0].clone()
            r.mark(out, r.pinned_storages)
            return out
        if func is torch.Tensor.is_pinned:
            return r.pinned(args[0])
        to_device, pin = _is_cuda(kwargs.get("device")), kwargs.get("pin_memory") is True
        if to_device:
            kwargs["device"] = torch.device("cpu")
        if pin:
            kwargs["pin_memory"] = False
        with torch._C.DisableTorchFunction():
            out = func(*args, **kwargs)
        for t in tree_flatten(out)[0] if (to_device or pin) else ():
            if isinstance(t, torch.Tensor):
                r.mark(t, r.device_storages if to_device else r.pinned_storages)
        return out

    def _to(self, func, args, kwargs):
        r, t = self.rules, args[0]
        if func is torch.Tensor.to:
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
        else:
            device, dtype, non_blocking = torch.device(func.__name__), None, kwargs.get("non_blocking", False)
        on_device = r.on_device(t)
        to_device = on_device if device is None else device.type == "cuda"
        with torch._C.DisableTorchFunction():
            out = t.to(dtype=dtype) if dtype is not None else t
            if to_device != on_device and out.untyped_storage()._cdata == t.untyped_storage()._cdata:
                out = out.clone()  # a copy between the host and the device: never the same memory
        if to_device and not on_device:
            r.copy("host->device", non_blocking, t)
            r.mark(out, r.device_storages)
        elif on_device and not to_device:
            r.copy("device->host", non_blocking, None)
            r.device_storages.pop(out.untyped_storage()._cdata, None)
            if non_blocking:  # torch pins a non-blocking copy to the host
                r.mark(out, r.pinned_storages)
        return out


class _Spread(TorchDispatchMode):
    """Every op's result on the device when one of its inputs is; a non-blocking copy_ between the host and the
    device needs pinned host memory."""

    def __init__(self, rules: CudaRules):
        super().__init__()
        self.rules = rules

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        r = self.rules
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            non_blocking = args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False)
            if r.on_device(dst) != r.on_device(src):
                r.copy("host->device" if r.on_device(dst) else "device->host", non_blocking,
                       src if r.on_device(dst) else dst)
        out = func(*args, **(kwargs or {}))
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if any(r.on_device(a) for a in flat) and func is not aten.copy_.default:
            inputs = {a.untyped_storage()._cdata for a in flat}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in inputs:  # not in place, a view
                    r.mark(t, r.device_storages)
        return out


class CudaRules:
    def __init__(self, allow: tuple[str, ...] = (), memory_limit: int | None = None):
        self.allow = allow  # violations recorded, not raised: "pageable-host->device" (a copy without overlap)
        self.memory_limit, self.peak = memory_limit, 0
        self.device_storages: dict[int, StorageWeakRef] = {}
        self.device_bytes: dict[int, int] = {}  # each device storage's size when it was made
        self.pinned_storages: dict[int, StorageWeakRef] = {}
        self.set_devices: list[int] = []
        self.collectives: list[tuple[str, bool]] = []
        self.copies: list[tuple[str, bool, bool]] = []
        self.backends: list[str] = []

    # ---- where a tensor is
    def mark(self, t: torch.Tensor, where: dict) -> None:
        storage = t.untyped_storage()
        where[storage._cdata] = StorageWeakRef(storage)
        if where is self.device_storages:
            self.device_bytes[storage._cdata] = storage.nbytes()
            self.allocated()

    # ---- memory
    def memory_allocated(self) -> int:
        """Bytes of the live device storages (the freed ones leave the tables here)."""
        for key in [k for k, ref in self.device_storages.items() if ref.expired()]:
            del self.device_storages[key], self.device_bytes[key]
        return sum(self.device_bytes.get(k, 0) for k in self.device_storages)

    def allocated(self) -> None:
        """After an allocation on the device: its peak, or the GPU's error past the limit."""
        now = self.memory_allocated()
        if self.memory_limit is not None and now > self.memory_limit:
            raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in): {now} bytes would be allocated, "
                                         f"limit {self.memory_limit}")
        self.peak = max(self.peak, now)

    def reset_peak(self, *_) -> None:
        self.peak = self.memory_allocated()

    def properties(self, *_):
        return types.SimpleNamespace(name=NAME, major=9, minor=0, multi_processor_count=132,
                                     total_memory=self.memory_limit or TOTAL_MEMORY)

    @staticmethod
    def _in(t, where: dict) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = where.get(t.untyped_storage()._cdata)
        return ref is not None and not ref.expired()

    def on_device(self, t) -> bool:
        return self._in(t, self.device_storages)

    def pinned(self, t) -> bool:
        return self._in(t, self.pinned_storages)

    def copy(self, direction: str, non_blocking: bool, host) -> None:
        pinned = host is None or self.pinned(host)
        self.copies.append((direction, bool(non_blocking), pinned))
        if non_blocking and not pinned and f"pageable-{direction}" not in self.allow:
            raise CudaViolation(f"a non-blocking {direction} copy from pageable host memory: pin the host side "
                                f"(pin_memory()), or the copy is synchronous (host->device) or racy (device->host)")

    # ---- the patches
    def _collective(self, op: str, real):
        @functools.wraps(real)
        def collective(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
            host = [t for t in tensors if not self.on_device(t)]
            self.collectives.append((op, not host))
            if host:
                raise CudaViolation(f"NCCL refuses this {op}: a tensor on the host, not on the GPU ('No backend type "
                                    f"associated with device type cpu')")
            return real(*args, **kwargs)
        return collective

    def _init_process_group(self, real):
        @functools.wraps(real)
        def init(backend=None, *args, **kwargs):
            self.backends.append(str(backend))
            return real("gloo" if backend == "nccl" else backend, *args, **kwargs)
        return init

    def _ddp_init(self, real):
        from torch._utils import _get_device_index

        @functools.wraps(real)
        def init(ddp, module, *args, device_ids=None, output_device=None, **kwargs):
            if device_ids is not None:
                [_get_device_index(d, True) for d in device_ids]  # DDP's own check on a GPU module
            return real(ddp, module, *args, **kwargs)
        return init

    def _set_device_index(self, index: int) -> None:
        if not 0 <= index < 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index}")
        self.set_devices.append(index)

    def __enter__(self) -> CudaRules:
        # torch._dynamo before the patches: a tensor placed on "cuda" imports it, and imported under the patches it
        # keeps the patched autocast queries in its tables for the rest of the process (a later compile then breaks).
        import pytest
        import torch._dynamo  # noqa: F401

        self.patch = pytest.MonkeyPatch()
        c = torch.cuda
        for name, value in (("is_available", lambda: True), ("device_count", lambda: 1),
                            ("current_device", lambda: 0), ("get_device_name", lambda *a: NAME),
                            ("get_device_capability", lambda *a: (9, 0)),
                            ("is_bf16_supported", lambda *a, **k: True), ("_lazy_init", lambda: None),
                            ("synchronize", lambda *a: None), ("reset_peak_memory_stats", self.reset_peak),
                            ("max_memory_allocated", lambda *a: self.peak),
                            ("memory_allocated", lambda *a: self.memory_allocated()),
                            ("get_device_properties", self.properties), ("get_rng_state", lambda *a: torch.get_rng_state()),
                            ("set_rng_state", lambda state, *a: torch.set_rng_state(state)), ("Event", _Event)):
            self.patch.setattr(c, name, value)
        self.patch.setattr(torch._C, "_cuda_setDevice", self._set_device_index, raising=False)
        # autocast on "cuda" is CPU autocast here (the tensors' real device): the same casts as on the GPU
        autocast_init = torch.amp.autocast_mode.autocast.__init__
        self.patch.setattr(torch.amp.autocast_mode.autocast, "__init__", lambda ac, device_type, *a, **k: autocast_init(
            ac, "cpu" if device_type == "cuda" else device_type, *a, **k))
        for name in ("is_autocast_enabled", "get_autocast_dtype"):
            real = getattr(torch, name)
            self.patch.setattr(torch, name, lambda *a, real=real: real(*["cpu" if x == "cuda" else x for x in a]))
        for op in COLLECTIVES:
            self.patch.setattr(dist, op, self._collective(op, getattr(dist, op)))
        self.patch.setattr(dist, "init_process_group", self._init_process_group(dist.init_process_group))
        ddp = torch.nn.parallel.DistributedDataParallel
        self.patch.setattr(ddp, "__init__", self._ddp_init(ddp.__init__))
        self.modes = [_Spread(self), _Placement(self)]
        for mode in self.modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self.modes):
            mode.__exit__(*exc)
        self.patch.undo()


def main(argv: list[str]) -> None:
    """`python tests/cuda_standin.py -m MODULE ARGS...`: MODULE's main under the rules; a JSON line of what they
    recorded last (`cuda-standin: {...}`)."""
    import json

    if argv[:1] != ["-m"] or len(argv) < 2:
        raise SystemExit("usage: python tests/cuda_standin.py -m MODULE [ARGS...]")
    sys.argv = [argv[1], *argv[2:]]
    code = 0
    with CudaRules(allow=tuple(filter(None, os.environ.get("CUDA_STANDIN_ALLOW", "").split(",")))) as rules:
        try:
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    print("cuda-standin: " + json.dumps({"set_devices": rules.set_devices, "backends": rules.backends,
                                         "collectives": rules.collectives, "copies": rules.copies}), flush=True)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
