"""An independent reference for every distributed run: the optimisation replayed in one process.

A run (Ray or in-process, any world size, resumed or not) records the sample ids each rank consumed at
each optimizer step (the `record_sample_ids` test hook). `replay` rebuilds what the run must have
computed, with none of the run's machinery: no Trainer, no stream, no restore, no DDP, and none of
minilm's optimisation code (`minilm.step`, `minilm.schedule` are not imported; the model class is
shared). It

* checks the recorded ids against the order contract written out here (epoch e's seeded permutation,
  step s takes positions [s*G, (s+1)*G), rank r the r-th contiguous slice), for the attempt of each step that
  counted;
* seeds a model as every rank does (`torch.manual_seed(seed)`), builds `torch.optim.AdamW` with the
  parameter groups written out here (decay on matrices only), and for each step 0..T-1 runs MiniMind's
  loop as the seed lists it: lr from the formula written here, then for every micro-batch of every
  rank (the dropout RNG seeded per step and rank, as the run promises) an autocast forward,
  `(loss + aux_loss) x rows / G`, backward; then unscale, clip, step (skipped when the
  gradient norm is not finite), scaler update, zero grad;
* returns the final fp32 weights and the loss, lr and gradient norm of every step, to compare with the
  run's checkpoint and with each record of its metrics.jsonl (`check_run`).

So a bug the run's code shares with another run of the same code (an lr one step late after a
restore, the loss divided by the accumulation twice or not at all, clipping before unscaling, ranks
slicing the global batch wrongly) shows up here, where a same-code baseline would not see it; and the
gradient norm shows what clipping hides in the weights (a gradient scaled x2 clips to the same step).

Muon runs (`optimizer="muon"`) use minilm's `Muon` and its parameter groups (`minilm.muon`): the
optimizer itself is not re-implemented here, everything around it (lr, groups' lr ratio, accumulation,
clip, skip) is.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from helpers import max_rel_diff

from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
ADAMW_EPS = 1e-8  # torch's default, which the run keeps


@dataclass
class Replay:
    weights: dict[str, torch.Tensor]
    loss: dict[int, float]  # optimizer step (1-based) -> mean loss over the global batch
    lr: dict[int, float]
    grad_norm: dict[int, float]  # before clipping, in unscaled units
    scaler_state: dict | None = None  # the GradScaler's state after the last step (fp16 runs)


def recorded_ranks(record_dir: Path) -> dict[int, list[list[int]]]:
    """optimizer_step -> each rank's sample ids (rank order), from the attempt of each step that counted (after a
    restart a step can be recorded twice: the newest records, one per rank, are the ones kept)."""
    records: dict[int, list[dict]] = {}
    for f in sorted(Path(record_dir).glob("rank*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            records.setdefault(rec["optimizer_step"], []).append(rec)
    steps = {}
    for step, recs in sorted(records.items()):
        recs.sort(key=lambda r: r["time"], reverse=True)
        latest = recs[: recs[0]["world_size"]]  # the newest attempt: one record per rank
        assert sorted(r["rank"] for r in latest) == list(range(recs[0]["world_size"])), f"step {step}: {latest}"
        steps[step] = [r["sample_ids"] for r in sorted(latest, key=lambda r: r["rank"])]
    return steps


def recorded_steps(record_dir: Path) -> dict[int, list[int]]:
    """optimizer_step -> the global batch's sample ids in rank order (see `recorded_ranks`)."""
    return {step: [i for ids in ranks for i in ids] for step, ranks in recorded_ranks(record_dir).items()}


def expected_global_batch(num_sequences: int, val_samples: int, seed: int, global_batch_size: int,
                          step: int) -> list[int]:
    """The ids of optimizer step `step` (0-based) by the order contract, written out plainly."""
    train_ids, _ = D.split_ids(num_sequences, val_samples)
    per_epoch = len(train_ids) // global_batch_size
    epoch, s = divmod(step, per_epoch)
    order = np.asarray(train_ids)[np.random.default_rng([seed, epoch]).permutation(len(train_ids))]
    return order[s * global_batch_size:(s + 1) * global_batch_size].tolist()


def scheduled_lr(step: int, total_steps: int, peak: float, warmup_steps: int, min_lr_ratio: float,
                 schedule: str = "cosine", decay_fraction: float = 0.2) -> float:
    """The lr of optimizer step `step` (0-based) as the product promises it: linear warmup from peak/warmup
    (step 0) to the peak (step warmup - 1), then MiniMind's cosine from the peak to min_lr_ratio x peak, or (wsd)
    the peak held until the last decay_fraction of the steps after warmup, then a straight line down to
    min_lr_ratio x peak, reached at the last step."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    t, span = step - warmup_steps, max(1, total_steps - warmup_steps)
    if schedule == "wsd":
        decaying = max(1, round(decay_fraction * span))
        done = step - (total_steps - decaying) + 1  # steps into the decay, this one included
        return peak if done <= 0 else peak * (1.0 - (1.0 - min_lr_ratio) * min(1.0, done / decaying))
    return peak * (min_lr_ratio + (1.0 - min_lr_ratio) / 2 * (1 + math.cos(math.pi * t / span)))


def dropout_seed(seed: int, step: int, rank: int) -> int:
    """The RNG seed of rank `rank` at optimizer step `step` (0-based): dropout masks are a function of the step."""
    return seed * 1_000_003 + step * 1009 + rank


def adamw_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on the matrices (linear and embedding weights), none on vectors (norm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, fused: bool) -> torch.optim.Optimizer:
    if cfg.optimizer == "muon":  # minilm's Muon, not re-implemented here (see the module docstring)
        from minilm.muon import Muon, muon_param_groups

        groups = muon_param_groups(model, lr=cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                                   embedding_lr_ratio=cfg.embedding_lr_ratio)
        return Muon(groups, lr=cfg.lr, momentum=cfg.muon_momentum, betas=tuple(cfg.betas))
    return torch.optim.AdamW(adamw_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=tuple(cfg.betas),
                             eps=ADAMW_EPS, foreach=False, fused=fused)


def autocast(dtype: torch.dtype):
    return contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device_type="cpu", dtype=dtype)


def replay(model_cfg: ModelConfig, train_cfg: TrainConfig, data_dir: Path, record_dir: Path, total_steps: int,
           val_samples: int = 0, *, fused: bool = False, nan_at_steps: tuple[int, ...] = ()) -> Replay:
    """Replay the run on the prepared data in `data_dir` whose sample ids are in `record_dir`.

    `fused=False` is MiniMind's `torch.optim.AdamW` (the for-loop kernel); `fused=True` torch's fused kernel, the
    one a CPU run of minilm uses: the same update written with other roundings, so only it can be compared bit
    for bit. `nan_at_steps`: the 1-based steps whose lm_head gradient the run's fault hook made NaN.
    """
    ranks_by_step = recorded_ranks(record_dir)
    assert sorted(ranks_by_step) == list(range(1, total_steps + 1)), f"recorded steps {sorted(ranks_by_step)}"
    prepared = D.open_prepared(data_dir)
    rows, num_sequences = D.SequenceStore(prepared), prepared.num_sequences
    G, m = train_cfg.global_batch_size, train_cfg.micro_batch_size
    dtype = DTYPES[train_cfg.dtype]
    torch.manual_seed(train_cfg.seed)
    model = MiniMindForCausalLM(model_cfg)
    model.train()
    optimizer = build_optimizer(model, train_cfg, fused)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)  # torch's defaults, as MiniMind's loop
    params = [p for g in optimizer.param_groups for p in g["params"]]  # what the optimizer steps (norm in this order)
    loss, lr, grad_norm = {}, {}, {}
    for step in range(total_steps):
        rank_ids = ranks_by_step[step + 1]
        ids = [i for r in rank_ids for i in r]
        want = expected_global_batch(num_sequences, val_samples, train_cfg.seed, G, step)
        assert sorted(ids) == sorted(want), f"optimizer step {step + 1}: the run read other samples than the order"
        assert ids == want, f"optimizer step {step + 1}: the ranks' slices are out of order"
        lr[step + 1] = scheduled_lr(step, total_steps, train_cfg.lr, train_cfg.warmup_steps, train_cfg.min_lr_ratio,
                                    train_cfg.schedule, train_cfg.decay_fraction)
        for group in optimizer.param_groups:
            group["lr"] = lr[step + 1] * group.get("lr_ratio", 1.0)
        # every micro-batch of every rank in one process (each rank's slice cut into micro-batches of at most m rows),
        # each weighted by its share of the G sequences: the gradient of the global batch's mean loss
        lm_sum, aux_sum = torch.zeros(()), torch.zeros(())
        nan = model.lm_head.weight.register_hook(lambda g: g * float("nan")) if step + 1 in nan_at_steps else None
        for rank, r_ids in enumerate(rank_ids):
            torch.manual_seed(dropout_seed(train_cfg.seed, step, rank))
            batch = torch.from_numpy(np.ascontiguousarray(rows.take(np.asarray(r_ids)))).long()
            for input_ids in batch.split(m):
                with autocast(dtype):
                    out = model(input_ids[:, :-1], targets=input_ids[:, 1:])  # seq_len positions, as minilm feeds them
                scaler.scale((out.loss + out.aux_loss) / (G / len(input_ids))).backward()
                lm_sum += out.loss.detach().float() * len(input_ids)
                aux_sum += out.aux_loss.detach().float() * len(input_ids)
        if nan is not None:
            nan.remove()
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, train_cfg.grad_clip)
        if scaler.is_enabled():
            scaler.step(optimizer)  # skips the step itself when the gradients hold inf or NaN
        elif torch.isfinite(norm):
            optimizer.step()
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loss[step + 1] = float(lm_sum / G + aux_sum / G)
        grad_norm[step + 1] = float(norm)
    return Replay({k: v.detach().clone() for k, v in model.state_dict().items()}, loss, lr, grad_norm,
                  scaler.state_dict() if scaler.is_enabled() else None)



def check_run(ref: Replay, weights: dict[str, torch.Tensor], metrics: list[dict], *, rtol_weights: float = 1e-5,
              rtol_loss: float = 1e-4, rtol_grad_norm: float = 1e-4) -> None:
    """Every logged lr, grad_norm and loss, step by step (the first step that differs names the mistake), then the
    run's final weights, against the replay."""
    assert metrics, "no metrics were logged"
    for rec in metrics:
        step = rec["optimizer_step"]
        assert rec["lr"] == ref.lr[step], f"step {step}: lr {rec['lr']} logged, the schedule says {ref.lr[step]}"
        want = ref.grad_norm[step]
        assert (rec["grad_norm"] == want or  # inf or NaN: equal as non-finite
                (not math.isfinite(want) and not math.isfinite(rec["grad_norm"])) or
                abs(rec["grad_norm"] - want) <= rtol_grad_norm * abs(want)), \
            f"step {step}: grad_norm {rec['grad_norm']} logged, the replay computed {want}"
        assert abs(rec["loss"] - ref.loss[step]) <= rtol_loss * abs(ref.loss[step]), \
            f"step {step}: loss {rec['loss']} logged, the replay computed {ref.loss[step]}"
    diff = max_rel_diff(weights, ref.weights)
    assert diff <= rtol_weights, f"final weights differ from the reference replay by {diff:.3g} (relative)"
