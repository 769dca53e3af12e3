"""The per-worker training function that Ray Train runs on every rank.

It reads like the seed's loop: restore state, then for each optimizer step take the rank's
micro-batches, set the lr, run `minilm.step.optimizer_step`, and at log/checkpoint steps report
to Ray Train (a barrier: every rank reports at the same steps; rank 0 attaches the checkpoint).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray.train
import torch
import torch.distributed as dist

from minilm import checkpoint as C
from minilm import data as D
from minilm.config import ModelConfig, TrainConfig, accumulation_steps
from minilm.model import MiniMindForCausalLM
from minilm.progress import MetricsLog, format_log_line, peak_flops
from minilm.schedule import get_lr
from minilm.step import (
    NonFiniteGuard,
    autocast,
    configure_backends,
    make_grad_scaler,
    make_optimizer,
    mean_across_workers,
    optimizer_step,
    prepare_model,
    resolve_dtype,
)
from minilm.trackers import Trackers, open_trackers, run_hparams

from . import dashboard_metrics
from .elastic import WorldSizeTimeline
from .stream import RankStream


class Preempted(RuntimeError):
    """SIGTERM reached a worker; a checkpoint was written at the step boundary before exiting."""


@dataclass
class Worker:
    """Everything one rank's loop needs, built once per (re)start of the worker group."""

    rank: int
    world_size: int
    model_cfg: ModelConfig
    train_cfg: TrainConfig
    run: dict
    prepared: D.PreparedData
    model: torch.nn.Module  # DDP-wrapped when world_size > 1
    raw_model: MiniMindForCausalLM
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    guard: NonFiniteGuard
    dtype: torch.dtype
    accumulation: int
    steps_per_epoch: int
    total_steps: int
    step: int
    run_id: str
    stream: RankStream | None = None
    metrics_log: MetricsLog | None = None
    val_ids: np.ndarray | None = None  # this rank's share of the held-out sequences
    val_store: D.SequenceStore | None = None
    last_checkpoint_s: float = 0.0  # wall time of the latest checkpoint (save + report), for the metrics
    timeline: WorldSizeTimeline | None = None  # rank 0 with a run folder: world_size.csv
    trackers: Trackers = field(default_factory=lambda: Trackers([]))  # rank 0: TensorBoard / MLflow / W&B
    redone_steps: int = 0  # optimizer steps recomputed after restarts of this run, in all

    def log(self, message: str) -> None:
        if self.rank == 0:
            say(message)

    def record(self, event: str) -> None:
        if self.timeline:
            self.timeline.record(self.step, self.world_size, self.accumulation, event)


def train_func(config: dict) -> None:
    w = setup(config)
    outcome = "failed"
    try:
        train_loop(w)
        outcome = "finished" if w.step >= w.total_steps else "killed"  # killed: --exit-after-*, to be continued
    except Preempted:
        outcome = "killed"
        raise
    finally:
        w.trackers.close(outcome)


def train_loop(w: Worker) -> None:
    cfg = w.train_cfg
    stop = StopSignal(w.run.get("exit_after_minutes"))
    exit_after_steps = w.run.get("exit_after_steps")
    meter = Meter(w, peak_flops(ray.train.torch.get_device(), w.dtype))
    while w.step < w.total_steps:
        micro_batches, sample_ids = w.stream.next_step()
        torch.manual_seed(cfg.seed * 1_000_003 + w.step * 1009 + w.rank)  # dropout RNG: a function of the step
        lr = get_lr(w.step, w.total_steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio)
        with _test_nonfinite_gradients(w):
            m = optimizer_step(w.model, w.optimizer, w.scaler, micro_batches, lr=lr, grad_clip=cfg.grad_clip,
                               dtype=w.dtype)
        w.step += 1
        w.guard.update(m, w.step, w.scaler.is_enabled())
        meter.add(m.tokens * w.world_size)
        if w.timeline:
            w.timeline.step_done(w.step)
        _test_hooks(w, sample_ids)

        reason = stop.check(w.world_size)  # SIGTERM, a node drain or --exit-after-minutes, agreed by all ranks
        exiting = reason is not None or (exit_after_steps is not None and w.step >= exit_after_steps)
        checkpointing = exiting or w.step == w.total_steps or w.step % cfg.checkpoint_every == 0
        evaluating = w.val_ids is not None and (w.step % w.run["eval_every"] == 0 or w.step == w.total_steps)
        if checkpointing or evaluating or w.step % cfg.log_every == 0:
            metrics = meter.metrics(m, lr)
            if evaluating:
                metrics["val_loss"] = validation_loss(w)
            report(w, metrics, checkpointing)
        if reason in (StopSignal.SIGTERM, StopSignal.DRAIN):
            w.record("preempt")
            raise Preempted(f"{reason} at optimizer step {w.step}: checkpoint written, exiting for a restart")
        if exiting:
            w.record("exit")
            w.log(f"exiting after optimizer step {w.step} as asked (--exit-after-steps/--exit-after-minutes); "
                  f"continue with --resume auto")
            return
    w.record("finish")


def setup(config: dict) -> Worker:
    """Build the model and optimizer, restore the checkpoint if there is one, open the data stream."""
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    model_cfg, train_cfg, run = ModelConfig.from_dict(config["model"]), TrainConfig.from_dict(config["train"]), config["run"]
    device = ray.train.torch.get_device()
    dtype = resolve_dtype(train_cfg.dtype, device)
    prepared = D.open_prepared(run["data_dir"])
    train_ids, val_ids = D.split_ids(prepared.num_sequences, run["val_samples"])
    per_epoch = D.steps_per_epoch(len(train_ids), train_cfg.global_batch_size)

    configure_backends(device)  # TF32 on Ampere+ GPUs
    torch.manual_seed(train_cfg.seed)  # identical initial weights on every rank
    # --compile and --activation-checkpointing act in place: state-dict keys, checkpoints and DDP are unchanged
    model = prepare_model(MiniMindForCausalLM(model_cfg).to(device), train_cfg, device)
    w = Worker(rank=rank, world_size=world_size, model_cfg=model_cfg, train_cfg=train_cfg, run=run, prepared=prepared,
               model=model, raw_model=model, optimizer=make_optimizer(model, train_cfg),
               scaler=make_grad_scaler(dtype, device.type), guard=NonFiniteGuard(train_cfg.max_nonfinite_steps),
               dtype=dtype, accumulation=accumulation_steps(train_cfg.global_batch_size, train_cfg.micro_batch_size,
                                                            world_size),
               steps_per_epoch=per_epoch, total_steps=train_cfg.max_steps or per_epoch * train_cfg.epochs,
               step=0, run_id=run["run_id"], val_ids=val_ids[rank::world_size] if len(val_ids) else None,
               metrics_log=MetricsLog(Path(run["run_dir"]) / "metrics.jsonl") if run.get("run_dir") else None)

    resumed = restore(w)
    if resumed is not None:
        w.step, w.run_id = int(resumed["optimizer_step"]), resumed.get("run_id", w.run_id)
        pos = D.DataPosition.at(w.step, per_epoch, train_cfg.global_batch_size)
        w.log(f"resumed run {run['name']} at optimizer step {w.step} (epoch {pos.epoch}, {pos.samples_seen} samples): "
              f"world size {resumed['world_size']} -> {world_size}, "
              f"accumulation {resumed['accumulation_steps']} -> {w.accumulation}")
    else:
        w.log(f"starting run {run['name']} fresh: {w.total_steps} optimizer steps of {train_cfg.global_batch_size} "
              f"sequences, world size {world_size} x accumulation {w.accumulation} x micro-batch "
              f"{train_cfg.micro_batch_size}, dtype {str(dtype).removeprefix('torch.')}, "
              f"{model.num_params() / 1e6:.2f}M parameters ({model.num_params(active=True) / 1e6:.2f}M active)")
    if w.metrics_log and rank == 0:
        w.metrics_log.truncate_after(w.step)  # steps about to be redone leave the file: its step axis never goes back
    if rank == 0 and run.get("trackers"):
        w.trackers = open_trackers(
            run["trackers"], run_dir=run.get("run_dir"), run_name=run["name"], start_step=w.step,
            resume_state=(resumed or {}).get("trackers"), options=run.get("tracker_options"), say=say,
            hparams=run_hparams(model_cfg.to_dict(), train_cfg.to_dict(), world_size=world_size,
                                data_fingerprint=prepared.fingerprint, tokenizer_sha256=prepared.tokenizer_sha256))
    if rank == 0 and run.get("run_dir"):
        w.timeline = WorldSizeTimeline(run["run_dir"])
        row = w.timeline.record_start(w.step, world_size, w.accumulation, resumed is not None)
        w.redone_steps = w.timeline.redone_steps_total()
        if row["event"] != "start":
            w.log(f"{row['event']}: world size {world_size} x accumulation {w.accumulation} from optimizer step "
                  f"{w.step}; {row['redone_steps']} step(s) done since that checkpoint are redone "
                  f"({w.redone_steps} redone in this run so far)")

    if world_size > 1:
        w.model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    w.stream = RankStream(data_dir=run["data_dir"], train_ids=train_ids, seed=train_cfg.seed,
                          global_batch_size=train_cfg.global_batch_size, micro_batch_size=train_cfg.micro_batch_size,
                          world_size=world_size, rank=rank, start_step=w.step, total_steps=w.total_steps,
                          steps_per_epoch=per_epoch,
                          device=device, reader_cpus=run.get("reader_cpus", 0.0))
    return w


class Meter:
    """Throughput, data wait and ETA over each log interval."""

    def __init__(self, w: Worker, peak_flops: float):
        self.w, self.peak = w, peak_flops
        self.t_start = self.t_mark = time.perf_counter()
        self.step_at_start, self.tokens, self.wait_mark = w.step, 0, 0.0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def metrics(self, m, lr: float) -> dict:
        w, now = self.w, time.perf_counter()
        losses = mean_across_workers(torch.stack([m.loss, m.lm_loss, m.aux_loss]).float())
        elapsed = now - self.t_mark
        tokens_per_s = self.tokens / elapsed
        pos = D.DataPosition.at(w.step, w.steps_per_epoch, w.train_cfg.global_batch_size)
        metrics = {
            "loss": float(losses[0]), "lm_loss": float(losses[1]), "aux_loss": float(losses[2]), "lr": lr,
            "grad_norm": float(m.grad_norm), "tokens_per_s": tokens_per_s,
            "mfu": w.raw_model.estimate_mfu(tokens_per_s / w.world_size, w.train_cfg.seq_len, self.peak),
            "optimizer_step": w.step, "total_steps": w.total_steps, "samples_seen": pos.samples_seen,
            "tokens_seen": pos.samples_seen * w.train_cfg.seq_len, "epoch": (w.step - 1) // w.steps_per_epoch,
            "epochs": -(-w.total_steps // w.steps_per_epoch), "world_size": w.world_size,
            "accumulation_steps": w.accumulation, "skipped_steps": w.guard.skipped_total,
            "data_wait_frac": (w.stream.data_wait_s - self.wait_mark) / elapsed,
            "checkpoint_s": w.last_checkpoint_s, "redone_steps": w.redone_steps,
            "eta_s": (now - self.t_start) / max(1, w.step - self.step_at_start) * (w.total_steps - w.step),
        }
        if w.raw_model.config.use_moe:
            metrics["expert_load"] = [[round(float(x), 4) for x in layer] for layer in w.raw_model.expert_load()]
        self.t_mark, self.tokens, self.wait_mark = now, 0, w.stream.data_wait_s
        return metrics


@torch.no_grad()
def validation_loss(w: Worker) -> float:
    """Mean next-token loss over the held-out sequences (each rank takes every W-th; summed over ranks)."""
    device = next(w.raw_model.parameters()).device
    if w.val_store is None:
        w.val_store = D.SequenceStore(w.prepared)  # loads shards once; later evaluations reuse them
    store = w.val_store
    w.raw_model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of losses x rows, rows)
    for chunk in np.array_split(w.val_ids, max(1, -(-len(w.val_ids) // w.train_cfg.micro_batch_size))):
        if len(chunk) == 0:
            continue
        ids = torch.as_tensor(store.take(chunk), dtype=torch.long, device=device)
        with autocast(device.type, w.dtype):
            loss = w.raw_model(ids, labels=ids).loss
        total += torch.stack([loss.double() * len(chunk), torch.tensor(float(len(chunk)), device=device).double()])
    w.raw_model.train()
    if w.world_size > 1:
        dist.all_reduce(total)
    return float(total[0] / total[1])


def checkpoint_state(w: Worker, metrics: dict) -> dict:
    """state.json of a resume checkpoint: the position (optimizer step) and what it must match on resume."""
    pos = D.DataPosition.at(w.step, w.steps_per_epoch, w.train_cfg.global_batch_size)
    return {
        "optimizer_step": w.step, "epoch": pos.epoch, "samples_seen": pos.samples_seen, "world_size": w.world_size,
        "micro_batch_size": w.train_cfg.micro_batch_size, "accumulation_steps": w.accumulation,
        "global_batch_size": w.train_cfg.global_batch_size, "total_steps": w.total_steps,
        "model_config": w.model_cfg.to_dict(), "train_config": w.train_cfg.to_dict(),
        "data_fingerprint": w.prepared.fingerprint, "tokenizer_sha256": w.prepared.tokenizer_sha256,
        "run_id": w.run_id, "run_name": w.run["name"], "nonfinite_guard": w.guard.state_dict(),
        "trackers": w.trackers.state_dict(),
        "rng": "derived: torch.manual_seed(seed * 1000003 + optimizer_step * 1009 + rank) every step",
        "loss": metrics["loss"],
    }


def _test_hooks(w: Worker, sample_ids: torch.Tensor) -> None:
    """Test-only: record consumed sample ids (--record-sample-ids); slow steps down or hold them (fault tests)."""
    if w.run.get("record_sample_ids"):
        with open(Path(w.run["record_sample_ids"]) / f"rank{w.rank}.jsonl", "a") as f:
            f.write(json.dumps({"optimizer_step": w.step, "world_size": w.world_size, "rank": w.rank,
                                "time": time.time(), "sample_ids": sample_ids.tolist()}) + "\n")
    delay = float(os.environ.get("MINILM_TEST_STEP_DELAY_S", "0") or 0)
    if delay:
        time.sleep(delay)
    hold = os.environ.get("MINILM_TEST_HOLD_FILE")  # elastic tests: wait here while a resize is arranged
    while hold and os.path.exists(hold):
        time.sleep(0.1)


@contextlib.contextmanager
def _test_nonfinite_gradients(w: Worker):
    """Test-only: MINILM_TEST_NAN_AT_STEPS="5,6" makes those optimizer steps' gradients NaN on every rank."""
    steps = os.environ.get("MINILM_TEST_NAN_AT_STEPS", "")
    if str(w.step + 1) not in steps.split(","):
        yield
        return
    handle = w.raw_model.lm_head.weight.register_hook(lambda grad: grad * float("nan"))
    try:
        yield
    finally:
        handle.remove()


def say(message: str) -> None:
    # To the process's real stdout: Ray Train's print patch would also tee print() and show it twice.
    print(message, file=sys.__stdout__, flush=True)


def report(w: Worker, metrics: dict, checkpointing: bool) -> None:
    """Every rank reports at the same steps (a barrier); rank 0 logs and attaches checkpoint + weights export."""
    if w.rank == 0:
        say(format_log_line(metrics))
        dashboard_metrics.publish(metrics, w.run["name"])  # Ray custom metrics: the dashboard's Metrics view
        if w.metrics_log:
            w.metrics_log.append({**metrics, "time": time.time(), "run_id": w.run_id})
        w.trackers.log(metrics, step=w.step)
    public = {k: v for k, v in metrics.items() if k != "expert_load"}
    if not checkpointing:
        ray.train.report(public)
        return
    tmp = tempfile.mkdtemp(prefix="minilm-ckpt-") if w.rank == 0 else None
    t0 = time.perf_counter()
    try:
        checkpoint = None
        if w.rank == 0:
            C.save_resume_state(tmp, model=w.raw_model, optimizer=w.optimizer, scaler=w.scaler,
                                state=checkpoint_state(w, metrics))
            C.export_weights(Path(tmp) / "weights", w.raw_model, w.model_cfg, w.prepared.tokenizer_path, step=w.step)
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        dir_name = checkpoint_dir_name(w.run.get("run_dir"), w.step)
        try:
            ray.train.report(public, checkpoint=checkpoint, checkpoint_dir_name=dir_name)
        except Exception as e:  # Ray's upload to the storage path: a full disk there is one clear line too
            if checkpoint is None or not C.is_disk_full(e):
                raise
            raise C.CheckpointError(C.write_error(f"{w.run.get('run_dir') or 'the storage path'}/{dir_name}", w.step,
                                                 "upload", e)) from None
        w.last_checkpoint_s = time.perf_counter() - t0
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


def restore(w: Worker) -> dict | None:
    """Load the checkpoint this run continues from, if any; return its state.json."""
    model, train_cfg, prepared = w.raw_model, w.train_cfg, w.prepared
    path = _checkpoint_to_resume(w.run, w.log)
    if path is None:
        return None
    resume = C.load_resume_state(path)
    s = resume.state
    problems = C.resume_problems(s, model.config, train_cfg.global_batch_size, train_cfg.seed, prepared.fingerprint)
    if problems:
        raise C.CheckpointError(f"cannot resume from {path}: " + "; ".join(problems))
    model.load_state_dict(resume.model_state, strict=True)
    w.optimizer.load_state_dict(resume.optimizer_state)
    w.scaler.load_state_dict(resume.scaler_state)
    w.guard.load_state_dict(s["nonfinite_guard"])
    return s


def _checkpoint_to_resume(run: dict, log) -> Path | None:
    """The newest complete checkpoint beside Ray's latest registered one (passing over incomplete ones); when Ray
    has none registered, the driver's `resume_path`: --resume PATH, or under --resume auto the newest complete
    checkpoint of the run folder (one Ray never registered: its driver was killed between upload and registration)."""
    latest = ray.train.get_checkpoint()
    if latest is not None:
        local = Path(latest.path)
        if local.is_dir():
            # Newer complete folders count too: a checkpoint uploaded just before its node died may not be
            # registered yet (the controller registers reports when it next polls the workers).
            candidates = sorted(p for p in local.parent.glob("checkpoint_*") if p.is_dir())
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
    """A stop agreed by all ranks at a step boundary: SIGTERM, a node drain, or --exit-after-minutes.

    SIGTERM is what Kubernetes and spot reclaims send a process; a drain is Ray's own notice that a
    node hosting a rank will be taken away (`ray drain-node`, the autoscaler, a preemption), seen
    through `ray.train.get_preemption_info()`. Either way the loop checkpoints at the step boundary
    and exits for a restart, so the restarted group redoes no step.
    """

    SIGTERM, DRAIN, TIME_UP = "SIGTERM", "node drain", "time limit"

    def __init__(self, exit_after_minutes: float | None):
        self.deadline = time.monotonic() + 60 * exit_after_minutes if exit_after_minutes else None
        self.sigterm = False
        try:
            signal.signal(signal.SIGTERM, self._on_sigterm)
        except ValueError:  # Ray runs train_func in a thread; Ray's own handler lives in the main thread
            _defer_ray_sigterm_exit(self._on_sigterm)

    def _on_sigterm(self, *_):
        self.sigterm = True

    def check(self, world_size: int) -> str | None:
        """Why to stop after this step (the same answer on every rank), or None. A collective."""
        time_up = self.deadline is not None and time.monotonic() > self.deadline
        drain = ray.train.get_preemption_info() is not None  # a barrier: every rank calls it every step
        flags = torch.tensor([float(self.sigterm), float(drain), float(time_up)])
        if world_size > 1 and dist.is_initialized():
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        for reason, flag in zip((self.SIGTERM, self.DRAIN, self.TIME_UP), flags.tolist(), strict=True):
            if flag > 0:
                return reason
        return None


def _defer_ray_sigterm_exit(on_sigterm) -> None:
    """Let the first SIGTERM reach the step boundary instead of exiting the worker at once.

    Ray's worker SIGTERM handler (main thread) exits through
    `ray._private.worker.raise_sys_exit_with_custom_error_message`, looked up at call time. The
    first SIGTERM only sets our flag, so the loop checkpoints at the next step boundary and then
    raises; a second SIGTERM exits as Ray would. If Ray renames that function, SIGTERM exits as usual.
    """
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "raise_sys_exit_with_custom_error_message", None)
    if original is None:
        return
    seen = []

    def deferred(message, exit_code=1, *args, **kwargs):
        if "SIGTERM" in str(message) and not seen:
            seen.append(time.time())
            on_sigterm()
            return
        return original(message, exit_code, *args, **kwargs)

    ray_worker.raise_sys_exit_with_custom_error_message = deferred


__all__ = ["train_func", "Preempted"]
