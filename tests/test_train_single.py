"""The single-process entry: `python -m minilm.train` runs, learns, and refuses bad flags cleanly."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from minilm.config import ConfigError, ModelConfig, TrainConfig
from minilm.options import RunOptions
from minilm.schedule import get_lr
from minilm.train import LocalLauncher, sequences_from_tokens
from minilm.trainer import Dataset, Trainer

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4, vocab_size=256,
            max_position_embeddings=128)
SMALL_FLAGS = ["--hidden-size", "64", "--num-hidden-layers", "2", "--vocab-size", "256", "--seq-len", "32",
               "--micro-batch-size", "4", "--global-batch-size", "8"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "minilm.train", *args], capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.timeout(120)
def test_cli_runs_and_exits_zero():
    r = run_cli("--random-tokens", "20000", "--max-steps", "5", "--log-every", "1", "--warmup-steps", "0",
                *SMALL_FLAGS)
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stdout.splitlines() if line.startswith("epoch ")]
    assert [line.split()[3] for line in lines] == [f"{i}/5" for i in range(1, 6)]
    assert "done: finished at optimizer step 5/5" in r.stdout
    assert "Traceback" not in r.stderr


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, sequences: torch.Tensor, log) -> tuple:
    """The Trainer on `sequences` (N, seq_len + 1) in this process, world size 1: the model and the metrics of
    every log step."""
    model_cfg.validate()
    train_cfg.validate()
    data = Dataset.in_memory(sequences.numpy())
    trainer = Trainer(model_cfg, train_cfg, RunOptions(name="in-process"), data,
                      LocalLauncher(data, train_cfg.micro_batch_size, say=log))
    try:
        trainer.fit()
    finally:
        trainer.close("finished")
    return trainer.raw_model, trainer.history


def repeated_sequences(rows: int = 64, distinct: int = 4, seq_len: int = 32) -> torch.Tensor:
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 256, size=(distinct, seq_len + 1))
    return torch.as_tensor(patterns[np.arange(rows) % distinct])


@pytest.mark.timeout(120)
def test_loss_falls_on_repeated_data():
    cfg = TrainConfig(lr=3e-3, max_steps=40, micro_batch_size=4, global_batch_size=8, seq_len=32, dtype="fp32",
                      log_every=1, warmup_steps=4)
    logs: list[str] = []
    model, history = train(ModelConfig(**TINY), cfg, repeated_sequences(), log=logs.append)
    losses = [h["loss"] for h in history]
    assert len(history) == 40 and [h["optimizer_step"] for h in history] == list(range(1, 41))
    assert losses[0] > 5.0  # ~ln(256) at init
    assert np.mean(losses[-5:]) < 0.5 * losses[0]
    assert history[-1]["skipped_steps"] == 0
    # The lr follows the schedule, one value per optimizer step.
    assert [h["lr"] for h in history] == [get_lr(s, 40, 3e-3, 4, 0.1, cfg.schedule, cfg.decay_fraction)
                                          for s in range(40)]
    assert [h["tokens_seen"] for h in history] == [8 * 32 * s for s in range(1, 41)]
    assert logs and " step 40/40 " in logs[-1]


def test_epochs_define_total_steps_without_max_steps():
    cfg = TrainConfig(lr=1e-3, epochs=2, micro_batch_size=4, global_batch_size=8, seq_len=32, dtype="fp32",
                      log_every=1)
    _, history = train(ModelConfig(**TINY), cfg, repeated_sequences(rows=20), log=lambda s: None)
    assert len(history) == 2 * (20 // 8)
    assert [h["epoch"] for h in history] == [0, 0, 1, 1]


def test_train_refuses_bad_config_and_too_little_data():
    with pytest.raises(ConfigError, match="warmup_steps"):
        train(ModelConfig(**TINY), TrainConfig(max_steps=3, warmup_steps=3, micro_batch_size=4, global_batch_size=8,
                                               dtype="fp32"), repeated_sequences(rows=16), log=lambda s: None)
    with pytest.raises(ValueError, match="do not fill one global batch of 8"):
        train(ModelConfig(**TINY), TrainConfig(max_steps=3, micro_batch_size=4, global_batch_size=8, dtype="fp32"),
              repeated_sequences(rows=7), log=lambda s: None)


def test_sequences_from_tokens():
    rows = sequences_from_tokens(np.arange(100), seq_len=9)
    assert rows.shape == (10, 10) and rows.dtype == torch.int64
    assert rows[1, 0].item() == 10  # consecutive, non-overlapping rows
    assert sequences_from_tokens(np.arange(25), seq_len=9).shape == (2, 10)  # the tail is dropped
    with pytest.raises(ValueError, match="do not fill one sequence"):
        sequences_from_tokens(np.arange(5), seq_len=9)
