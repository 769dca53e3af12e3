"""The per-worker training function that Ray Train runs on every rank.

It reads like the seed's loop: restore state, then for each optimizer step take the rank's
micro-batches, set the lr, run `minilm.step.optimizer_step`, and at log/checkpoint steps report
to Ray Train (a barrier: every rank reports at the same steps; rank 0 attaches the checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import ray.train
import torch
import torch.distributed as dist

from minilm import checkpoint as C
from minilm import data as D
from minilm.config import ModelConfig, TrainConfig, accumulation_steps
from minilm.model import MiniMindForCausalLM
from minilm.progress import MetricsLog, format_log_line, peak_flops
from minilm.schedule import get_lr
from minilm.step import NonFiniteGuard, make_grad_scaler, make_optimizer, mean_across_workers, optimizer_step, \
    resolve_dtype

from .stream import RankStream


class Preempted(RuntimeError):
    """SIGTERM reached a worker; a checkpoint was written at the step boundary before exiting."""


def train_func(config: dict) -> None:
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    model_cfg = ModelConfig.from_dict(config["model"])
    train_cfg = TrainConfig.from_dict(config["train"])
    run = config["run"]
    log = say if rank == 0 else (lambda msg: None)

    device = ray.train.torch.get_device()
    dtype = resolve_dtype(train_cfg.dtype, device)
    accumulation = accumulation_steps(train_cfg.global_batch_size, train_cfg.micro_batch_size, world_size)
    prepared = D.open_prepared(run["data_dir"])
    train_ids, val_ids = D.split_ids(prepared.num_sequences, run["val_samples"])
    per_epoch = D.steps_per_epoch(len(train_ids), train_cfg.global_batch_size)
    total_steps = train_cfg.max_steps or per_epoch * train_cfg.epochs

    torch.manual_seed(train_cfg.seed)  # identical initial weights on every rank
    model = MiniMindForCausalLM(model_cfg).to(device)
    optimizer = make_optimizer(model, train_cfg)
    scaler = make_grad_scaler(dtype, device.type)
    guard = NonFiniteGuard(train_cfg.max_nonfinite_steps)
    metrics_log = MetricsLog(Path(run["run_dir"]) / "metrics.jsonl") if run.get("run_dir") else None

    step, run_id = 0, run["run_id"]
    resumed = restore(model, optimizer, scaler, guard, run, train_cfg, prepared, log)
    if resumed is not None:
        step, run_id = int(resumed["optimizer_step"]), resumed.get("run_id", run_id)
        pos = D.DataPosition.at(step, per_epoch, train_cfg.global_batch_size)
        log(f"resumed run {run['name']} at optimizer step {step} (epoch {pos.epoch}, {pos.samples_seen} samples): "
            f"world size {resumed['world_size']} -> {world_size}, "
            f"accumulation {resumed['accumulation_steps']} -> {accumulation}")
    else:
        log(f"starting run {run['name']} fresh: {total_steps} optimizer steps of {train_cfg.global_batch_size} "
            f"sequences, world size {world_size} x accumulation {accumulation} x micro-batch "
            f"{train_cfg.micro_batch_size}, dtype {str(dtype).removeprefix('torch.')}, "
            f"{model.num_params() / 1e6:.2f}M parameters ({model.num_params(active=True) / 1e6:.2f}M active)")

    if metrics_log and rank == 0:
        metrics_log.truncate_after(step)  # steps about to be redone leave the file: its step axis never goes back
    if world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    raw_model: MiniMindForCausalLM = model.module if world_size > 1 else model
    stream = RankStream(data_dir=run["data_dir"], train_ids=train_ids, seed=train_cfg.seed,
                        global_batch_size=train_cfg.global_batch_size, micro_batch_size=train_cfg.micro_batch_size,
                        world_size=world_size, rank=rank, start_step=step, steps_per_epoch=per_epoch, device=device,
                        reader_cpus=run.get("reader_cpus", 0.0))
    peak = peak_flops(device, dtype)
    stop = StopSignal(run.get("exit_after_minutes"))
    record_ids = run.get("record_sample_ids")
    exit_after_steps = run.get("exit_after_steps")

    test_step_delay = float(os.environ.get("MINILM_TEST_STEP_DELAY_S", "0") or 0)  # fault tests: widen the window
    t_interval, tokens_interval, wait_mark = time.perf_counter(), 0, 0.0
    t_start, step_at_start = t_interval, step
    while step < total_steps:
        micro_batches, sample_ids = stream.next_step()
        torch.manual_seed(train_cfg.seed * 1_000_003 + step * 1009 + rank)  # dropout RNG: a function of the step
        lr = get_lr(step, total_steps, train_cfg.lr, train_cfg.warmup_steps, train_cfg.min_lr_ratio)
        m = optimizer_step(model, optimizer, scaler, micro_batches, lr=lr, grad_clip=train_cfg.grad_clip, dtype=dtype)
        guard.update(m, step, scaler.is_enabled())
        step += 1
        if test_step_delay:
            time.sleep(test_step_delay)
        tokens_interval += m.tokens * world_size
        if record_ids:
            with open(Path(record_ids) / f"rank{rank}.jsonl", "a") as f:
                f.write(json.dumps({"optimizer_step": step, "world_size": world_size,
                                    "sample_ids": sample_ids.tolist()}) + "\n")

        sigterm, time_up = stop.check(world_size)
        exiting = sigterm or time_up or (exit_after_steps is not None and step >= exit_after_steps)
        last = step == total_steps
        checkpointing = last or exiting or step % train_cfg.checkpoint_every == 0
        if not (checkpointing or step % train_cfg.log_every == 0):
            continue

        now = time.perf_counter()
        losses = mean_across_workers(torch.stack([m.loss, m.lm_loss, m.aux_loss]).float())
        elapsed = now - t_interval
        tokens_per_s = tokens_interval / elapsed
        pos = D.DataPosition.at(step, per_epoch, train_cfg.global_batch_size)
        metrics = {
            "loss": float(losses[0]), "lm_loss": float(losses[1]), "aux_loss": float(losses[2]), "lr": lr,
            "grad_norm": float(m.grad_norm), "tokens_per_s": tokens_per_s,
            "mfu": raw_model.estimate_mfu(tokens_per_s / world_size, train_cfg.seq_len, peak),
            "optimizer_step": step, "total_steps": total_steps, "samples_seen": pos.samples_seen,
            "tokens_seen": pos.samples_seen * train_cfg.seq_len,
            "epoch": (step - 1) // per_epoch,
            "epochs": -(-total_steps // per_epoch), "world_size": world_size, "accumulation_steps": accumulation,
            "skipped_steps": guard.skipped_total, "data_wait_frac": (stream.data_wait_s - wait_mark) / elapsed,
            "eta_s": (now - t_start) / max(1, step - step_at_start) * (total_steps - step),
        }
        if raw_model.config.use_moe:
            metrics["expert_load"] = [[round(float(x), 4) for x in layer] for layer in raw_model.expert_load()]
        if rank == 0:
            say(format_log_line(metrics))
            if metrics_log:
                metrics_log.append({**metrics, "time": time.time(), "run_id": run_id})
        t_interval, tokens_interval, wait_mark = now, 0, stream.data_wait_s

        state = None
        if checkpointing:
            state = {
                "optimizer_step": step, "epoch": pos.epoch, "samples_seen": pos.samples_seen,
                "world_size": world_size, "micro_batch_size": train_cfg.micro_batch_size,
                "accumulation_steps": accumulation, "global_batch_size": train_cfg.global_batch_size,
                "total_steps": total_steps, "model_config": model_cfg.to_dict(), "train_config": train_cfg.to_dict(),
                "data_fingerprint": prepared.fingerprint, "tokenizer_sha256": prepared.tokenizer_sha256,
                "run_id": run_id, "run_name": run["name"], "nonfinite_guard": guard.state_dict(),
                "rng": "derived: torch.manual_seed(seed * 1000003 + optimizer_step * 1009 + rank) every step",
                "loss": metrics["loss"],
            }
        report(metrics, state, rank, raw_model, optimizer, scaler, prepared, run)
        if sigterm:
            raise Preempted(f"SIGTERM at optimizer step {step}: checkpoint written, exiting for a restart")
        if exiting:
            log(f"exiting after optimizer step {step} as asked (--exit-after-steps/--exit-after-minutes); "
                f"continue with --resume auto")
            return


def say(message: str) -> None:
    # To the process's real stdout: Ray Train's print patch would also tee print() and show it twice.
    print(message, file=sys.__stdout__, flush=True)


def report(metrics, state, rank, model, optimizer, scaler, prepared, run) -> None:
    """Every rank reports (a barrier); rank 0 attaches the checkpoint and a weights export."""
    public = {k: v for k, v in metrics.items() if k != "expert_load"}
    if state is None:
        ray.train.report(public)
        return
    tmp = tempfile.mkdtemp(prefix="minilm-ckpt-") if rank == 0 else None
    try:
        checkpoint = None
        if rank == 0:
            C.save_resume_state(tmp, model=model, optimizer=optimizer, scaler=scaler, state=state)
            C.export_weights(Path(tmp) / "weights", model, model.config, prepared.tokenizer_path)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report(public, checkpoint=checkpoint,
                         checkpoint_dir_name=checkpoint_dir_name(run.get("run_dir"), state["optimizer_step"]))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def checkpoint_dir_name(run_dir: str | None, step: int) -> str:
    """checkpoint_<step>, or checkpoint_<step>_<k> when a folder of that name is already there (a step
    redone after falling back past a corrupt or unregistered checkpoint must not write into it)."""
    name = f"checkpoint_{step:08d}"
    if run_dir is None:
        return name
    k = 0
    candidate = name
    while (Path(run_dir) / candidate).exists():
        k += 1
        candidate = f"{name}_{k}"
    return candidate


def restore(model, optimizer, scaler, guard, run, train_cfg, prepared, log) -> dict | None:
    """Load the checkpoint this run continues from, if any; return its state.json."""
    path = _checkpoint_to_resume(run, log)
    if path is None:
        return None
    resume = C.load_resume_state(path)
    s = resume.state
    problems = []
    if s["global_batch_size"] != train_cfg.global_batch_size:
        problems.append(f"global_batch_size {train_cfg.global_batch_size} != {s['global_batch_size']} in the checkpoint "
                        f"(the global batch is the invariant of a run)")
    if s["model_config"] != model.config.to_dict():
        problems.append("the model config differs from the checkpoint's")
    if s["data_fingerprint"] != prepared.fingerprint:
        problems.append(f"the data fingerprint {prepared.fingerprint[:12]} differs from the checkpoint's "
                        f"{s['data_fingerprint'][:12]} (different --data)")
    if s["train_config"]["seed"] != train_cfg.seed:
        problems.append(f"seed {train_cfg.seed} != {s['train_config']['seed']} in the checkpoint")
    if problems:
        raise C.CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
    model.load_state_dict(resume.model_state, strict=True)
    optimizer.load_state_dict(resume.optimizer_state)
    scaler.load_state_dict(resume.scaler_state)
    guard.load_state_dict(s["nonfinite_guard"])
    return s


def _checkpoint_to_resume(run: dict, log) -> Path | None:
    """Ray's latest checkpoint of this run (falling back past incomplete ones), else --resume PATH."""
    latest = ray.train.get_checkpoint()
    if latest is not None:
        local = Path(latest.path)
        if local.is_dir():
            candidates = sorted(p for p in local.parent.glob("checkpoint_*") if p.is_dir() and p <= local)
            found = C.latest_complete(candidates, log)
            if found is None:
                raise C.CheckpointError(f"run {run['name']} has checkpoints under {local.parent} but none is complete")
            return found
        with latest.as_directory() as d:  # remote storage: download the latest and verify it
            dst = Path(tempfile.mkdtemp(prefix="minilm-resume-"))
            shutil.copytree(d, dst, dirs_exist_ok=True)
            return dst
    if run.get("resume_path"):
        return Path(run["resume_path"])
    return None


class StopSignal:
    """A stop agreed by all ranks at a step boundary: SIGTERM (preemption) or --exit-after-minutes."""

    def __init__(self, exit_after_minutes: float | None):
        self.deadline = time.monotonic() + 60 * exit_after_minutes if exit_after_minutes else None
        self.sigterm = False
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # not the main thread: Ray's own SIGTERM handling applies
            pass

    def _on_sigterm(self, *_):
        self.sigterm = True

    def check(self, world_size: int) -> tuple[bool, bool]:
        """(sigterm on any rank, time limit reached on any rank); a collective when world_size > 1."""
        time_up = self.deadline is not None and time.monotonic() > self.deadline
        flags = torch.tensor([float(self.sigterm), float(time_up)])
        if world_size > 1 and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0] > 0), bool(flags[1] > 0)


__all__ = ["train_func", "Preempted"]
