"""One optimizer step per worker, as MiniMind's loop lists it, with no host sync: a non-finite gradient norm skips
the update on the device, and the metrics stay tensors until a log step reads them."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import torch

from .config import ModelConfig, TrainConfig
from .model import MiniMindForCausalLM, MoEFeedForward
from .muon import Muon, muon_param_groups, native_bf16, orthogonalize
from .progress import measured_matmul_peak

# The one table of --dtype names (minilm.config.DTYPES, less "auto") and their torch dtypes.
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient norm."""


def resolve_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """Map --dtype to a torch dtype for this device; `auto` picks the fastest safe choice."""
    device_type = torch.device(device).type
    if name == "auto":
        if device_type == "cuda":
            # native bf16 only: V100 and T4 emulate it, slower than fp16 with the GradScaler
            return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
        # A start-up probe: is a bf16 matmul faster than fp32 here? Without native bf16 units (AVX512-BF16 or AMX)
        # bf16 is emulated, ~10x slower: not worth the seconds a timing takes.
        if not native_bf16("cpu"):
            return torch.float32
        fp32 = measured_matmul_peak(torch.float32, 512, 8)
        return torch.bfloat16 if measured_matmul_peak(torch.bfloat16, 512, 8) > 1.25 * fp32 else torch.float32
    if name == "fp16" and device_type != "cuda":
        raise ValueError("dtype fp16 needs a CUDA device (CPU autocast supports bf16 or fp32); use --dtype bf16 or fp32")
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


# --optimizer auto's rule, in one place: Muon reached MiniMind's loss in 0.40-0.56 of AdamW's steps (docs/quality.md),
# so it is ahead while its step costs under 1/0.56 of AdamW's; half a step leaves a margin, and keeps the measured
# shapes (the demo's 11-27%, MiniMind's 74-101% on a CPU) well away from the line, whatever the machine's load.
MUON_MAX_SHARE = 0.5  # of a step's forward + backward, the most Newton-Schulz may take for auto to choose muon


def choose_optimizer(ns_s: float | None, step_s: float | None) -> tuple[str, str]:
    """--optimizer auto: muon while one Newton-Schulz pass (`ns_s`) takes at most MUON_MAX_SHARE of a step's forward +
    backward (`step_s`), else adamw; not timed (None, on a GPU, where it is a few percent): muon. (name, why)."""
    if ns_s is None or step_s is None:
        return "muon", "auto: on a GPU Newton-Schulz is a few percent of a step"
    share = ns_s / step_s
    name = "muon" if share <= MUON_MAX_SHARE else "adamw"
    return name, f"auto: Newton-Schulz {ns_s:.2f} s = {share:.0%} of a step, muon up to {MUON_MAX_SHARE:.0%}"


def check_memory(model_cfg: ModelConfig) -> None:
    """A CPU run's weights, gradients and AdamW moments (16 bytes a parameter) must fit in the memory this machine has
    free: past it, the kernel kills the process while the model is built or steps, with no error line."""
    params = model_cfg.num_params()
    need, free = 16 * params, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    with contextlib.suppress(OSError, StopIteration):  # Linux's estimate of what can be had without swapping
        with open("/proc/meminfo") as f:
            free = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    if need > free:
        raise MemoryError(f"{params / 1e9:.2f}B parameters need ~{need / 2**30:.0f} GiB for weights, "
                          f"gradients and optimizer state; this machine has {free / 2**30:.0f} GiB free")


def time_muon(model_cfg: ModelConfig, train_cfg: TrainConfig, world_size: int = 1) -> tuple[float, float]:
    """On this CPU: one Newton-Schulz pass over the model's Muon matrices (one matrix of each shape timed, times how
    many there are: a pass over all of them took 25-36 s at the default shape), and one rank's forward + backward of
    a step (one sequence timed, times the rank's sequences: a probe never needs more memory or time than a step);
    each the better of a warm-up and a second. Timed, not estimated from FLOPs: with AMX a bf16 step ran at a fifth
    of the matmul peak, not near it."""
    check_memory(model_cfg)
    model = MiniMindForCausalLM(model_cfg)
    groups = muon_param_groups(model, lr=1.0, muon_lr=1.0, weight_decay=0.0, embedding_lr_ratio=1.0)
    counts = Counter(p.shape for p in groups[0]["params"])
    one_of_each = [(torch.randn(shape), n) for shape, n in counts.items()]
    rows = -(-train_cfg.global_batch_size // world_size)  # rank 0's share, the largest
    # at most the model's positions: an in-process Trainer takes its rows' length from the data, not from seq_len
    ids = torch.randint(model_cfg.vocab_size, (1, min(train_cfg.seq_len, model_cfg.max_position_embeddings) + 1))

    def newton_schulz() -> float:
        total = 0.0
        for g, n in one_of_each:
            t0 = time.perf_counter()
            orthogonalize(g)
            total += (time.perf_counter() - t0) * n
        return total

    def forward_backward() -> float:
        t0 = time.perf_counter()
        with autocast("cpu", TORCH_DTYPES[train_cfg.dtype]):
            out = model(ids[:, :-1], targets=ids[:, 1:])
        (out.loss + out.aux_loss).backward()
        return time.perf_counter() - t0

    # the better of two: the first warms up, and another process's work only ever adds time
    ns_s = min(newton_schulz(), newton_schulz())
    return ns_s, min(forward_backward(), forward_backward()) * rows


def resolve_auto(model_cfg: ModelConfig, train_cfg: TrainConfig, device: torch.device | str,
                 world_size: int = 1) -> str:
    """Settle --dtype auto and --optimizer auto in `train_cfg` for this device, once per run (a resume's came from
    its checkpoint already); returns why auto chose the optimizer ("" when it was given)."""
    train_cfg.dtype = DTYPE_NAMES[resolve_dtype(train_cfg.dtype, device)]
    if train_cfg.optimizer != "auto":
        return ""
    timed = (None, None) if torch.device(device).type == "cuda" else time_muon(model_cfg, train_cfg, world_size)
    train_cfg.optimizer, why = choose_optimizer(*timed)
    return why


def autocast(device_type: str, dtype: torch.dtype):
    """Autocast for bf16/fp16; fp32 runs without it. fp32 master weights are kept either way."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=dtype)


def make_grad_scaler(dtype: torch.dtype, device_type: str) -> torch.amp.GradScaler:
    # Only fp16 needs loss scaling: bf16 has fp32's exponent range.
    return torch.amp.GradScaler(device_type, enabled=(dtype == torch.float16))


def configure_backends(device: torch.device | str) -> None:
    """TF32 matmuls on CUDA GPUs with TF32 units (Ampere and later): fp32 work several times faster, sums in fp32."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or torch.cuda.get_device_capability(device) < (8, 0):
        return
    # The legacy setters: setting fp32_precision would make the legacy getters raise (Inductor's autotuning calls them).
    torch.set_float32_matmul_precision("high")
    torch.backends.cudnn.allow_tf32 = True


# PyTorch's allocator with expandable segments grows a segment in place instead of caching blocks of fixed sizes:
# less memory lost to fragmentation as shapes vary (an uneven last micro-batch, validation).
CUDA_ALLOC_CONF = "expandable_segments:True"


def cuda_alloc_env() -> dict[str, str]:
    """The allocator setting a CUDA training process starts with (before CUDA does: it is read once): ours, unless
    the user set one (PYTORCH_CUDA_ALLOC_CONF, or torch's newer PYTORCH_ALLOC_CONF)."""
    user = {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & os.environ.keys()
    return {} if user else {"PYTORCH_CUDA_ALLOC_CONF": CUDA_ALLOC_CONF}


def prepare_model(model: torch.nn.Module, cfg: TrainConfig, device: torch.device | str) -> torch.nn.Module:
    """Apply `cfg.activation_checkpointing` and `cfg.compile` in place (after `.to(device)`, before DDP); the
    state-dict keys do not change. "blocks" is regional: each block, identical, so one compilation serves them all;
    "model" compiles the whole forward, the loss's chunked head (`minilm.loss.HeadLoss`) in the same graph."""
    inner = model.model  # MiniMindModel
    inner.activation_checkpointing = bool(cfg.activation_checkpointing)
    if cfg.compile != "off":
        # Inductor compiles C++ for CPU kernels; without a compiler the first step would fail.
        if torch.device(device).type == "cpu" and not any(shutil.which(cc) for cc in ("c++", "g++", "clang++")):
            raise RuntimeError("compile on CPU needs a C++ compiler (c++, g++ or clang++) on PATH; "
                               "install one or run without --compile")
        # The split dispatch's experts run eagerly inside a compiled block: their data-dependent slice sizes would
        # recompile it at every routing change. Not a decorator: `torch.compiler.disable` costs ~1 s of import.
        if not getattr(MoEFeedForward._dispatch, "_torchdynamo_disable", False):
            MoEFeedForward._dispatch = torch.compiler.disable(MoEFeedForward._dispatch)
        for module in [model] if cfg.compile == "model" else inner.layers:
            module.compile()
    return model


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only; with `cfg.optimizer == "muon"`, `minilm.muon.Muon`."""
    if cfg.optimizer == "muon":
        groups = muon_param_groups(model, lr=cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                   embedding_lr_ratio=cfg.embedding_lr_ratio)
        return Muon(groups, lr=cfg.lr, momentum=cfg.muon_momentum, betas=tuple(cfg.betas))
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # The fused kernel (CPU and CUDA) is faster than foreach: AdamW is memory-bound.
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's lr for this step; a group with an `lr_ratio` (Muon's) runs at lr x ratio."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


@dataclass
class StepMetrics:
    """What one optimizer step measured on this worker (tensors stay on device until logged)."""

    loss: torch.Tensor  # this rank's mean over its micro-batches (token-weighted) of lm_loss + aux_loss
    lm_loss: torch.Tensor
    aux_loss: torch.Tensor
    grad_norm: torch.Tensor  # before clipping, in unscaled units
    lr: float
    skipped: torch.Tensor  # bool: the optimizer step was skipped (non-finite gradient norm)
    sequences: int
    tokens: int
    share: float = 1.0  # this rank's share of the global batch: the weight of its means in the mean over ranks


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                   micro_batches: Sequence[torch.Tensor], *, lr: float, grad_clip: float,
                   dtype: torch.dtype = torch.float32, shares: Sequence[float] | None = None,
                   world_size: int = 1) -> StepMetrics:
    """Run len(micro_batches) micro-steps, each (rows, seq_len + 1) ids on the device, and one optimizer step.
    `shares`: each micro-batch's exact share of the global batch (default: of these rows)."""
    rows = [mb.shape[0] for mb in micro_batches]
    shares = list(shares) if shares is not None else [Fraction(n, sum(rows)) for n in rows]
    device_type = micro_batches[0].device.type
    set_lr(optimizer, lr)
    sums = torch.zeros(2, device=micro_batches[0].device)  # lm_loss and aux_loss, each x its micro-batch's rows
    for i, (input_ids, share) in enumerate(zip(micro_batches, shares, strict=True)):
        last = i == len(micro_batches) - 1
        # DDP all-reduces gradients in backward; skip that on all micro-steps but the last.
        sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            with autocast(device_type, dtype):
                out = model(input_ids[:, :-1], targets=input_ids[:, 1:])
            # x share x W (DDP divides by W): the all-reduced gradient is the global batch's mean loss's, exactly.
            loss = (out.loss + out.aux_loss) / float(1 / (Fraction(share) * world_size))
            scaler.scale(loss).backward()
        sums += torch.stack([out.loss, out.aux_loss]).detach().float() * input_ids.shape[0]

    # Gradients are scaled (fp16); bring them to true units before clipping against grad_clip.
    scaler.unscale_(optimizer)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    skipped = ~torch.isfinite(grad_norm)
    if scaler.is_enabled():
        scaler.step(optimizer)  # skips by itself (on the device) when it found inf/nan in the gradients
    else:
        step_unless_nonfinite(optimizer, skipped)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)

    lm_loss, aux_loss = sums / sum(rows)
    return StepMetrics(loss=lm_loss + aux_loss, lm_loss=lm_loss, aux_loss=aux_loss, grad_norm=grad_norm.detach(),
                       lr=lr, skipped=skipped, sequences=sum(rows),
                       tokens=sum(rows) * (micro_batches[0].shape[1] - 1), share=float(sum(shares)))


def step_unless_nonfinite(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """optimizer.step(), skipped where `found_inf` (0-dim bool, on the device) is true: on the device for optimizers
    of torch's amp protocol (fused AdamW, Muon), else with one host sync."""
    if getattr(optimizer, "_step_supports_amp_scaling", False):
        optimizer.grad_scale, optimizer.found_inf = None, found_inf.float()
        try:
            optimizer.step()
        finally:
            del optimizer.grad_scale, optimizer.found_inf
    elif not bool(found_inf):
        optimizer.step()


class NonFiniteGuard:
    """Counts skipped steps in device tensors (no host sync); trips after `max_in_a_row` non-finite steps in a row.
    With a GradScaler, overflows are its calibration: only a non-finite *loss* counts there."""

    def __init__(self, max_in_a_row: int, device: torch.device | str = "cpu"):
        self.max_in_a_row = max_in_a_row
        zero = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped_total, self.in_a_row, self.first_step_in_a_row = (zero.clone() for _ in range(3))
        self.tripped_at, self.trip_first_step = zero.clone(), zero.clone()  # the run of steps that tripped
        self.trip_loss, self.trip_grad_norm = (torch.zeros((), dtype=torch.float32, device=device) for _ in range(2))

    def update(self, metrics: StepMetrics, optimizer_step: int, scaler_enabled: bool = False) -> None:
        skipped = metrics.skipped
        counts = skipped & ~torch.isfinite(metrics.loss) if scaler_enabled else skipped
        self.skipped_total += skipped.long()
        starts = counts & (self.in_a_row == 0)
        self.first_step_in_a_row = torch.where(starts, optimizer_step, self.first_step_in_a_row)
        # a good step resets the count; a skip that does not count (scaler calibration) leaves it
        self.in_a_row = torch.where(counts, self.in_a_row + 1, torch.where(skipped, self.in_a_row, 0))
        trips = (self.tripped_at == 0) & (self.in_a_row >= self.max_in_a_row)
        self.tripped_at = torch.where(trips, optimizer_step, self.tripped_at)
        self.trip_first_step = torch.where(trips, self.first_step_in_a_row, self.trip_first_step)
        self.trip_loss = torch.where(trips, metrics.loss.detach().float(), self.trip_loss)
        self.trip_grad_norm = torch.where(trips, metrics.grad_norm.float(), self.trip_grad_norm)

    def tripped(self) -> torch.Tensor:
        return self.tripped_at > 0

    def check(self) -> None:
        """Raise NonFiniteLossError if the limit was reached (reads the device counters)."""
        tripped_at = int(self.tripped_at)
        if tripped_at:
            raise NonFiniteLossError(
                f"stopping: {self.max_in_a_row} optimizer steps in a row ({int(self.trip_first_step)}.."
                f"{tripped_at}) had a non-finite loss or gradient norm (last loss {float(self.trip_loss):.4g}, "
                f"grad_norm {float(self.trip_grad_norm):.4g}); lower --lr, add --warmup-steps, or check the data")

    STATE = ("skipped_total", "in_a_row", "first_step_in_a_row")  # the counters a checkpoint keeps

    def state_dict(self) -> dict:
        return {name: int(getattr(self, name)) for name in self.STATE}

    def load_state_dict(self, state: dict) -> None:
        for name in self.STATE:
            getattr(self, name).fill_(int(state[name]))
