"""Single-process training on a tensor of token ids: the loop without Ray, for debugging and benchmarks.

    python -m minilm.train --tokens ids.npy --hidden-size 128 --num-hidden-layers 2 --max-steps 50
    python -m minilm.train --data data/tok --max-steps 50
    python -m minilm.train --random-tokens 200000 --max-steps 20      # synthetic ids, for timing

It uses the same config, schedule, sample order and `optimizer_step` as the Ray job.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from . import data as D
from .config import ConfigError, ModelConfig, TrainConfig
from .model import MiniMindForCausalLM
from .schedule import get_lr
from .step import (
    NonFiniteGuard,
    configure_backends,
    make_grad_scaler,
    make_optimizer,
    optimizer_step,
    prepare_model,
    resolve_dtype,
)


def sequences_from_tokens(tokens: np.ndarray, seq_len: int) -> torch.Tensor:
    """Cut a 1-D array of token ids into (N, seq_len + 1) rows (the tail that does not fill a row is dropped)."""
    n = len(tokens) // (seq_len + 1)
    if n == 0:
        raise ValueError(f"{len(tokens)} tokens do not fill one sequence of seq_len + 1 = {seq_len + 1}")
    return torch.as_tensor(np.asarray(tokens[: n * (seq_len + 1)], dtype=np.int64).reshape(n, seq_len + 1))


def train(model_cfg: ModelConfig, train_cfg: TrainConfig, sequences: torch.Tensor, *, device: str = "cpu",
          log=print, model: MiniMindForCausalLM | None = None) -> tuple[MiniMindForCausalLM, list[dict]]:
    """Train on `sequences` (N, seq_len + 1) with world size 1; returns the model and per-step metrics."""
    model_cfg.validate()
    train_cfg.validate(world_size=1)
    if sequences.shape[1] > model_cfg.max_position_embeddings:
        raise ConfigError([f"rows of {sequences.shape[1]} tokens exceed max_position_embeddings "
                           f"({model_cfg.max_position_embeddings})"])
    per_epoch = D.steps_per_epoch(len(sequences), train_cfg.global_batch_size)
    if per_epoch == 0:
        raise ValueError(f"{len(sequences)} sequences do not fill one global batch of {train_cfg.global_batch_size}")
    total_steps = train_cfg.max_steps or per_epoch * train_cfg.epochs
    train_cfg.validate(world_size=1, total_steps=total_steps)

    configure_backends(device)
    torch.manual_seed(train_cfg.seed)
    model = (model or MiniMindForCausalLM(model_cfg)).to(device).train()
    prepare_model(model, train_cfg, device)  # --compile, --activation-checkpointing (in place)
    dtype = resolve_dtype(train_cfg.dtype, device)
    optimizer = make_optimizer(model, train_cfg)
    scaler = make_grad_scaler(dtype, torch.device(device).type)
    guard = NonFiniteGuard(train_cfg.max_nonfinite_steps)
    order = D.RankOrder(np.arange(len(sequences), dtype=np.int64), train_cfg.seed, per_epoch,
                        train_cfg.global_batch_size, world_size=1, rank=0, start_step=0)
    stream = D.LocalRankStream(D.RowsInMemory(sequences.numpy()), order, train_cfg.micro_batch_size, device)
    history: list[dict] = []
    t_last = time.perf_counter()
    for step in range(total_steps):
        pos = D.DataPosition.at(step, per_epoch, train_cfg.global_batch_size)
        micro_batches, _ = stream.next_step()
        lr = get_lr(step, total_steps, train_cfg.lr, train_cfg.warmup_steps, train_cfg.min_lr_ratio)
        m = optimizer_step(model, optimizer, scaler, micro_batches, lr=lr, grad_clip=train_cfg.grad_clip, dtype=dtype)
        guard.update(m, step + 1, scaler.is_enabled())  # steps are counted from 1 in logs and messages
        now = time.perf_counter()
        record = {"optimizer_step": step + 1, "epoch": pos.epoch, "loss": float(m.loss), "lm_loss": float(m.lm_loss),
                  "aux_loss": float(m.aux_loss), "lr": lr, "grad_norm": float(m.grad_norm),
                  "skipped": m.skipped, "tokens": m.tokens, "step_time_s": now - t_last}
        t_last = now
        history.append(record)
        if (step + 1) % train_cfg.log_every == 0 or step + 1 == total_steps:
            log(f"step {step + 1}/{total_steps} loss {record['loss']:.4f} lr {lr:.3e} "
                f"grad_norm {record['grad_norm']:.3f} tokens/s {m.tokens / record['step_time_s']:.0f}")
    return model, history


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minilm.train", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokens", help="a .npy file of 1-D token ids")
    src.add_argument("--data", help="a directory written by ray_jobs.prepare")
    src.add_argument("--random-tokens", type=int, help="train on this many uniformly random token ids")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-hidden-layers", type=int, default=2)
    p.add_argument("--vocab-size", type=int, default=6400)
    p.add_argument("--use-moe", action="store_true")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each transformer block in backward (less memory, more compute)")
    args = p.parse_args(argv)
    try:
        model_cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                                vocab_size=args.vocab_size, use_moe=args.use_moe)
        train_cfg = TrainConfig(lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps,
                                epochs=args.epochs, micro_batch_size=args.micro_batch_size,
                                global_batch_size=args.global_batch_size, dtype=args.dtype, seq_len=args.seq_len,
                                log_every=args.log_every, seed=args.seed, compile=args.compile,
                                activation_checkpointing=args.activation_checkpointing)
        model_cfg.validate()
        train_cfg.validate(world_size=1)
        if args.data:
            prepared = D.open_prepared(args.data)
            D.check_compatible(prepared, vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len)
            sequences = torch.as_tensor(D.SequenceStore(prepared).take(np.arange(prepared.num_sequences))).long()
        elif args.tokens:
            sequences = sequences_from_tokens(np.load(args.tokens), args.seq_len)
        else:
            rng = np.random.default_rng(args.seed)
            sequences = sequences_from_tokens(rng.integers(0, args.vocab_size, args.random_tokens), args.seq_len)
        train(model_cfg, train_cfg, sequences)
    except (ConfigError, D.DataError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
