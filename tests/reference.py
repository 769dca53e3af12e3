"""An independent reference for every distributed run: the optimisation replayed in one process.

A run (Ray or in-process, any world size, resumed or not) records the sample ids each rank consumed at
each optimizer step (the `record_sample_ids` test hook). `replay` rebuilds what the run must have
computed, with none of the run's machinery: no Trainer, no stream, no restore, no DDP. It

* checks the recorded ids against the order contract written out here (epoch e's seeded permutation,
  step s takes positions [s*G, (s+1)*G), rank r the r-th G/W slice), for the attempt of each step that
  counted;
* seeds a model as every rank does (`torch.manual_seed(seed)`), then for each step 0..T-1 takes the
  global batch's rows, splits them into micro-batches of the run's size (accumulation G/m in one
  process) and calls `optimizer_step` with `get_lr(step, T, ...)` computed here from the config;
* returns the final fp32 weights and the loss and lr of every step, to compare with the run's
  checkpoint (1e-5 relative) and with each record of its metrics.jsonl.

So a bug the run's code shares with another run of the same code (an lr one step late after a
restore, the loss divided by the accumulation twice, ranks slicing the global batch wrongly) shows up
here, where a same-code baseline would not see it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.model import MiniMindForCausalLM
from minilm.schedule import get_lr
from minilm.step import make_grad_scaler, make_optimizer, optimizer_step


@dataclass
class Replay:
    weights: dict[str, torch.Tensor]
    loss: dict[int, float]  # optimizer step (1-based) -> mean loss over the global batch
    lr: dict[int, float]


def recorded_steps(record_dir: Path) -> dict[int, list[int]]:
    """optimizer_step -> the global batch's sample ids in rank order, from the attempt of each step that counted
    (after a restart a step can be recorded twice: the newest records, one per rank, are the ones kept)."""
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
        steps[step] = [i for r in sorted(latest, key=lambda r: r["rank"]) for i in r["sample_ids"]]
    return steps


def expected_global_batch(num_sequences: int, val_samples: int, seed: int, global_batch_size: int,
                          step: int) -> list[int]:
    """The ids of optimizer step `step` (0-based) by the order contract, written out plainly."""
    train_ids, _ = D.split_ids(num_sequences, val_samples)
    per_epoch = len(train_ids) // global_batch_size
    epoch, s = divmod(step, per_epoch)
    order = np.asarray(train_ids)[np.random.default_rng([seed, epoch]).permutation(len(train_ids))]
    return order[s * global_batch_size:(s + 1) * global_batch_size].tolist()


def replay(model_cfg: ModelConfig, train_cfg: TrainConfig, data_dir: Path, record_dir: Path, total_steps: int,
           val_samples: int = 0) -> Replay:
    """Replay the run on the prepared data in `data_dir` whose sample ids are in `record_dir` (dropout 0)."""
    steps = recorded_steps(record_dir)
    assert sorted(steps) == list(range(1, total_steps + 1)), f"recorded steps {sorted(steps)}"
    prepared = D.open_prepared(data_dir)
    rows, num_sequences = D.SequenceStore(prepared), prepared.num_sequences
    G, m = train_cfg.global_batch_size, train_cfg.micro_batch_size
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[train_cfg.dtype]
    torch.manual_seed(train_cfg.seed)
    model = MiniMindForCausalLM(model_cfg)
    optimizer = make_optimizer(model, train_cfg)
    scaler = make_grad_scaler(dtype, "cpu")
    loss, lr = {}, {}
    for step in range(total_steps):
        ids = steps[step + 1]
        want = expected_global_batch(num_sequences, val_samples, train_cfg.seed, G, step)
        assert sorted(ids) == sorted(want), f"optimizer step {step + 1}: the run read other samples than the order"
        assert ids == want, f"optimizer step {step + 1}: the ranks' slices are out of order"
        batch = torch.from_numpy(np.ascontiguousarray(rows.take(np.asarray(ids)))).long()
        lr[step + 1] = get_lr(step, total_steps, train_cfg.lr, train_cfg.warmup_steps, train_cfg.min_lr_ratio,
                              train_cfg.schedule, train_cfg.decay_fraction)
        result = optimizer_step(model, optimizer, scaler, list(batch.split(m)), lr=lr[step + 1],
                                grad_clip=train_cfg.grad_clip, dtype=dtype)
        loss[step + 1] = float(result.loss)
    return Replay({k: v.detach().clone() for k, v in model.state_dict().items()}, loss, lr)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-12)).item()
               for k in a)


def check_run(ref: Replay, weights: dict[str, torch.Tensor], metrics: list[dict], *, rtol_weights: float = 1e-5,
              rtol_loss: float = 1e-4) -> None:
    """The run's final weights and every logged lr and loss against the replay."""
    diff = max_rel_diff(weights, ref.weights)
    assert diff < rtol_weights, f"final weights differ from the reference replay by {diff:.3g} (relative)"
    assert metrics, "no metrics were logged"
    for rec in metrics:
        step = rec["optimizer_step"]
        assert rec["lr"] == ref.lr[step], f"step {step}: lr {rec['lr']} logged, the schedule says {ref.lr[step]}"
        assert abs(rec["loss"] - ref.loss[step]) <= rtol_loss * abs(ref.loss[step]), \
            f"step {step}: loss {rec['loss']} logged, the replay computed {ref.loss[step]}"
