"""Runs of the training loop without Ray, for the tests of its logic: `minilm.trainer.Trainer` in this process
(world size 1), or `python -m minilm.train` under torchrun (plain DDP, 2 ranks on gloo).

The configuration is tests/runs.py's tiny Ray run, so an in-process run and a Ray run of the same data
compute the same optimisation (and the same reference replay, tests/reference.py, checks both).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import run_env
from helpers import ROOT, free_port
from safetensors.torch import load_file

from minilm import checkpoint as C
from minilm import data as D
from minilm.config import ModelConfig, TrainConfig
from minilm.testing import FaultHooks
from minilm.train import LocalLauncher
from minilm.trainer import Dataset, RunOptions, Trainer

STEPS = 20  # 15 steps per epoch on run_data (240 sequences, global batch 16): the runs cross an epoch
TINY_MODEL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
TINY_TRAIN = dict(lr=1e-3, warmup_steps=2, max_steps=STEPS, micro_batch_size=4, global_batch_size=16, log_every=4,
                  checkpoint_every=4, dtype="fp32", seq_len=32, optimizer="adamw")  # the replay's own AdamW (runs.py)


def configs(**train) -> tuple[ModelConfig, TrainConfig]:
    model = {k: train.pop(k) for k in list(train) if k in ModelConfig.__dataclass_fields__}
    return ModelConfig(**{**TINY_MODEL, **model}), TrainConfig(**{**TINY_TRAIN, **train})


def run_local(data_dir: Path, run_dir: Path, *, record: Path | None = None, resume: str = "auto",
              exit_after_steps: int | None = None, hooks: dict | None = None, keep_checkpoints: int = 3,
              abandon_newer: bool = False, **train) -> tuple[Trainer, str, list[str]]:
    """One Trainer in this process on the prepared data, --resume applied by the entry points' rule (without the
    lease); returns (trainer, outcome, log lines)."""
    model_cfg, train_cfg = configs(**train)
    data = Dataset.prepared(D.open_prepared(data_dir))
    lines: list[str] = []
    launcher = LocalLauncher(data, train_cfg.micro_batch_size, run_dir=run_dir, say=lines.append)
    fault_hooks = FaultHooks(record_sample_ids=str(record) if record else None, **(hooks or {}))
    run = RunOptions(name=Path(run_dir).name, run_dir=str(run_dir), exit_after_steps=exit_after_steps,
                     keep_checkpoints=keep_checkpoints)
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    decision = C.decide_resume(C.RunFolder(run_dir), resume, abandon_newer)
    decision.apply(C.RunFolder(run_dir), lines.append)
    run.resume_path = decision.origin
    if record:
        Path(record).mkdir(parents=True, exist_ok=True)
    trainer = Trainer(model_cfg, train_cfg, run, data, launcher, hooks=fault_hooks)
    outcome = "failed"
    try:
        outcome = trainer.fit()
    finally:
        trainer.close(outcome)
    return trainer, outcome, lines


def train_flags(data_dir: Path, run_dir: Path, **train) -> list[str]:
    """`python -m minilm.train` flags for the same configuration."""
    model_cfg, train_cfg = configs(**train)
    values = {**{k: getattr(model_cfg, k) for k in TINY_MODEL}, **{k: getattr(train_cfg, k) for k in TINY_TRAIN}}
    flags = ["--data", str(data_dir), "--run-dir", str(run_dir)]
    for k, v in values.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    return flags



def torchrun(nproc: int, flags: list[str], timeout: float = 240, check: bool = True,
             **env: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node N -m minilm.train FLAGS` (or the plain module for N = 1)."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                 str(free_port()), "-m", "minilm.train"] if nproc > 1 else [sys.executable, "-m", "minilm.train"])
    proc = subprocess.run([*launcher, *flags], cwd=ROOT, env=run_env(None, OMP_NUM_THREADS="1", **env),
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"minilm.train exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def checkpoint_weights(run_dir: Path, step: int = STEPS) -> dict:
    return load_file(str(Path(run_dir) / f"checkpoint_{step:08d}" / "model.safetensors"))
