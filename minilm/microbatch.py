"""--micro-batch-size auto: on a GPU, the largest micro-batch whose peak memory, measured before training on the real
model and step, leaves MEMORY_MARGIN of the device free; the least over ranks. Measured, not found by catching an
out-of-memory error mid-run, after which torch's state is not safe to go on with."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .config import TrainConfig
from .distributed import Collectives
from .step import TORCH_DTYPES, autocast, make_optimizer, step_unless_nonfinite

# Of the device's memory, what auto leaves to what the allocator's count misses: the CUDA context, fragmentation.
MEMORY_MARGIN = 0.1
MAX_PROBES = 4  # measured guesses after the one at a single sequence: the second lands, the others are for a bend
CPU_MICRO_BATCH = 16  # a CPU gains nothing from more, and has no allocator statistics to probe with


def resolve_micro_batch(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, world_size: int,
                        collectives: Collectives) -> tuple[int, str]:
    """The run's micro-batch on this rank: --micro-batch-size, or auto's choice and why ("" when it was given)."""
    if cfg.micro_batch_size != "auto":
        return cfg.micro_batch_size, ""
    rows = -(-cfg.global_batch_size // world_size)  # rank 0's slice: no micro-batch takes more
    if device.type != "cuda":
        return unprobed_micro_batch(cfg, world_size), f"auto: {CPU_MICRO_BATCH} on a CPU, at most the rank's {rows} sequences"
    with torch.random.fork_rng(devices=[device], device_type="cuda"):  # the run's numbers do not depend on auto
        m, why = probe(model, cfg, device, rows)
    least = int(collectives.all_reduce(torch.tensor([m]), op=dist.ReduceOp.MIN)[0].item())
    return least, why if least == m else f"{why}; {least}, the least over ranks"


def unprobed_micro_batch(cfg: TrainConfig, world_size: int) -> int:
    """The given micro-batch, or auto's where nothing is probed (a CPU): CPU_MICRO_BATCH, at most rank 0's slice."""
    if cfg.micro_batch_size != "auto":
        return cfg.micro_batch_size
    return min(CPU_MICRO_BATCH, -(-cfg.global_batch_size // world_size))


def probe(model: torch.nn.Module, cfg: TrainConfig, device: torch.device, most: int) -> tuple[int, str]:
    """The largest m <= `most` whose measured peak is under the limit. Each guess is the line through the peak at one
    sequence with the latest slope, then measured: the first slope, all of one sequence's bytes above the resting
    ones, is too steep for its guess to pass the limit; a measured guess gives the next its slope."""
    limit = int((1 - MEMORY_MARGIN) * torch.cuda.get_device_properties(device).total_memory)
    # The optimizer's state is counted by a second optimizer's step, one that commits nothing: the run's own takes none
    optimizer = make_optimizer(model, cfg)
    measured_peak(model, optimizer, cfg, device, 1)  # the gradients and the state made, as from a step's 2nd micro-batch
    one = measured_peak(model, optimizer, cfg, device, 1)
    per_row, peaks = max(one - torch.cuda.memory_allocated(device), 1), {1: one}
    for _ in range(MAX_PROBES):
        m = max(1, min(most, 1 + int((limit - one) // per_row)))
        if m in peaks:
            break
        peaks[m] = measured_peak(model, optimizer, cfg, device, m)
        per_row = max((peaks[m] - one) / (m - 1), 1)
    model.zero_grad(set_to_none=True)
    m = max(k for k, peak in peaks.items() if peak <= limit or k == 1)
    return m, (f"auto: peak {peaks[m] / 2**20:,.0f} MiB measured at {m}, {per_row / 2**20:,.1f} MiB a sequence, "
               f"limit {limit / 2**20:,.0f} MiB ({1 - MEMORY_MARGIN:.0%} of the device)")


def measured_peak(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig, device: torch.device,
                  m: int) -> int:
    """Peak bytes allocated through one forward + backward of m sequences under the run's autocast, and an optimizer
    step flagged non-finite (its state made and its kernels run; no weight changes)."""
    ids = torch.arange(m * (cfg.seq_len + 1), device=device).remainder_(model.config.vocab_size)
    ids = ids.view(m, cfg.seq_len + 1)  # no random draw: the run's RNG is untouched
    torch.cuda.reset_peak_memory_stats(device)
    with autocast(device.type, TORCH_DTYPES[cfg.dtype]):
        out = model(ids[:, :-1], targets=ids[:, 1:])
    (out.loss + out.aux_loss).backward()
    del out
    step_unless_nonfinite(optimizer, torch.ones((), dtype=torch.bool, device=device))
    return torch.cuda.max_memory_allocated(device)
