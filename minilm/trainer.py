"""The training loop, one for every launcher (`minilm.train`, torchrun, each Ray Train worker): a `Trainer` and its
`fit()` (docs/training-loop.md). The position is the optimizer step alone: the data order and the lr follow from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from . import checkpoint as C
from . import data as D
from . import step as S
from .bpb import bits_per_byte, token_byte_lengths
from .config import ModelConfig, TrainConfig, accumulation_steps
from .distributed import Collectives
from .eval_log import EvalInbox
from .microbatch import resolve_micro_batch, unprobed_micro_batch
from .model import MiniMindForCausalLM, resolve_gqa
from .options import RunOptions, StepPlan, plan_steps
from .policy import LoopPolicy
from .progress import Meter, MetricsLog, cuda_peak_memory, format_log_line, peak_flops
from .schedule import get_lr
from .testing import FaultHooks
from .timeline import WorldSizeTimeline
from .trackers import Trackers, open_trackers, run_hparams


class Preempted(RuntimeError):
    """SIGTERM or a node drain reached the run; a checkpoint was written at the step boundary before exiting."""


@dataclass
class Dataset:
    """The rows a run trains on, read by sample id, and what a resume must match."""

    store: object  # .take(sample_ids) -> (n, seq_len + 1) array
    num_sequences: int
    fingerprint: str
    tokenizer_sha256: str | None = None
    tokenizer_path: Path | None = None

    @classmethod
    def prepared(cls, prepared: D.PreparedData) -> Dataset:
        return cls(D.SequenceStore(prepared), prepared.num_sequences, prepared.fingerprint,
                   prepared.tokenizer_sha256, prepared.tokenizer_path)

    @classmethod
    def in_memory(cls, rows) -> Dataset:
        rows = np.ascontiguousarray(np.asarray(rows))
        return cls(D.RowsInMemory(rows), len(rows), "in-memory-" + hashlib.sha256(rows.tobytes()).hexdigest())


class Launcher(Protocol):
    """What differs between `minilm.train` and the Ray worker."""

    rank: int
    world_size: int
    device: torch.device
    micro_batch_size: int  # what `batches` cuts a step into: the Trainer sets the resolved --micro-batch-size
    storage: C.Storage  # where checkpoints are published and metrics reported (minilm.checkpoint.manager)

    def batches(self, order: D.RankOrder, total_steps: int):
        """This rank's stream to `total_steps`: yields (micro-batches on the device, host sample ids); `data_wait_s`."""

    def stop_flags(self) -> tuple[bool, bool]:
        """(SIGTERM seen, node drain announced) on this rank; called every step, so it must be cheap."""

    def say(self, message: str) -> None:
        """Print a line for a person (rank 0 calls it)."""


class Trainer:
    def __init__(self, model_cfg: ModelConfig, train_cfg: TrainConfig, run: RunOptions, data: Dataset,
                 launcher: Launcher, hooks: FaultHooks | None = None, model: MiniMindForCausalLM | None = None,
                 steps: StepPlan | None = None):
        self.model_cfg, self.train_cfg, self.run, self.data, self.launcher = model_cfg, train_cfg, run, data, launcher
        self.hooks = hooks or FaultHooks.from_dict(run.test_hooks) or FaultHooks()
        self.rank, self.world_size, self.device = launcher.rank, launcher.world_size, torch.device(launcher.device)
        # the entry points resolved "auto" already, once for every rank; an in-process run resolves it here
        self.optimizer_why = S.resolve_auto(model_cfg, train_cfg, self.device, self.world_size) or run.optimizer_why
        self.dtype = S.TORCH_DTYPES[train_cfg.dtype]
        val_ids = D.split_ids(data.num_sequences, train_cfg.val_samples)[1]
        self.val_ids = val_ids[self.rank::self.world_size] if len(val_ids) else None
        steps = steps or plan_steps(train_cfg, data.num_sequences, [self.world_size])  # the entry point's, if given
        self.steps_per_epoch, self.total_steps = steps.steps_per_epoch, steps.total_steps
        self.step, self.run_id = 0, run.run_id or f"{run.name}-{int(time.time())}"
        self.collectives = Collectives(self.device)

        S.configure_backends(self.device)  # TF32 on Ampere+ GPUs
        if self.device.type == "cpu":
            S.check_memory(model_cfg)
        torch.manual_seed(train_cfg.seed)  # identical initial weights on every rank
        # --compile and --activation-checkpointing act in place: state-dict keys, checkpoints and DDP are unchanged
        self.raw_model = S.prepare_model((model or MiniMindForCausalLM(model_cfg)).to(self.device), train_cfg,
                                       self.device)
        self.model: torch.nn.Module = self.raw_model  # DDP-wrapped below when world_size > 1
        # with auto, timed at the micro-batch a CPU takes: the probe below measures the path the run takes
        self.gqa = resolve_gqa(model_cfg, unprobed_micro_batch(train_cfg, self.world_size), train_cfg.seq_len,
                               self.dtype, self.device)
        self.optimizer = S.make_optimizer(self.raw_model, train_cfg)
        # auto is probed here, at every start (an elastic resize too), before a checkpoint's state is on the device
        m, self.micro_batch_why = resolve_micro_batch(self.raw_model, train_cfg, self.device, self.world_size,
                                                      self.collectives)
        self.micro_batch_size = launcher.micro_batch_size = m
        self.accumulation = accumulation_steps(train_cfg.global_batch_size, m, self.world_size)  # rank 0's, the most
        self.shares = [w for *_, w in D.rank_micro_batches(train_cfg.global_batch_size, m, self.world_size, self.rank)]
        self.scaler = S.make_grad_scaler(self.dtype, self.device.type)
        self.guard = S.NonFiniteGuard(train_cfg.max_nonfinite_steps, self.device)
        self.trackers = Trackers([])
        self.metrics_log = MetricsLog(Path(run.run_dir) / "metrics.jsonl") if run.run_dir and self.rank == 0 else None
        self.timeline = WorldSizeTimeline(run.run_dir) if run.run_dir and self.rank == 0 else None
        self.redone_steps, self.history = 0, []
        self.eval_inbox: EvalInbox | None = None  # rank 0, when checkpoints are scored beside training
        self.checkpoints = C.CheckpointManager(launcher.storage, train_cfg, rank=self.rank, device=self.device,
                                               keep=run.keep_checkpoints, origin=run.resume_path, hooks=self.hooks,
                                               export=C.WeightsExport(model_cfg, data.tokenizer_path),
                                               say=self.log_line, keep_unscored=bool(run.eval_task_names))
        self.token_bytes = None  # val_bpb's byte table, made at the first evaluation
        self.optimizer_step = S.optimizer_step
        self.start()
        self.hooks.install(self)  # a test's fault hooks go around the stream and the step, never into the loop

    def start(self) -> None:
        """Restore, open trackers and timeline, wrap in DDP, open the data stream at the restored step."""
        resumed = self.restore()
        cfg = self.train_cfg
        if resumed is not None:
            pos = D.DataPosition.at(self.step, self.steps_per_epoch, cfg.global_batch_size)
            self.log_line(f"resumed run {self.run.name} at optimizer step {self.step} (epoch {pos.epoch}, "
                          f"{pos.samples_seen} samples): world size {resumed['world_size']} -> {self.world_size}, "
                          f"accumulation {resumed['accumulation_steps']} -> {self.accumulation}{self.uneven()}"
                          + (f", micro-batch {self.micro_batch_size} ({self.micro_batch_why})" if self.micro_batch_why
                             else ""))
        else:
            self.log_line(f"starting run {self.run.name} fresh: {self.total_steps} optimizer steps of "
                          f"{cfg.global_batch_size} sequences, world size {self.world_size} x accumulation "
                          f"{self.accumulation} x micro-batch {self.micro_batch_size}"
                          + (f" ({self.micro_batch_why})" if self.micro_batch_why else "") + f"{self.uneven()}, dtype "
                          f"{str(self.dtype).removeprefix('torch.')}, optimizer {cfg.optimizer}"
                          + (f" ({self.optimizer_why})" if self.optimizer_why else "")
                          + f", GQA {self.gqa}"
                          + f", {self.raw_model.num_params() / 1e6:.2f}M parameters ({self.raw_model.num_params(active=True) / 1e6:.2f}M active)"
                          + (f", {torch.get_num_threads()} CPU thread(s) per worker" if self.device.type == "cpu"
                             else ""))
        if self.metrics_log:
            self.metrics_log.truncate_after(self.step)  # steps about to be redone leave the file
            if self.run.eval_task_names:
                self.eval_inbox = EvalInbox(self.run.run_dir, self.run.eval_task_names, self.metrics_log.read(),
                                            weights=lambda: C.held_weights(self.checkpoints.folder))
        if self.rank == 0 and self.run.trackers:
            self.trackers = open_trackers(
                self.run.trackers, run_dir=self.run.run_dir, run_name=self.run.name, start_step=self.step,
                resume_state=(resumed or {}).get("trackers"), options=self.run.tracker_settings(), say=self.log_line,
                hparams=run_hparams(self.model_cfg.to_dict(), cfg.to_dict(), world_size=self.world_size,
                                    data_fingerprint=self.data.fingerprint,
                                    tokenizer_sha256=self.data.tokenizer_sha256))
        if self.timeline:
            row = self.timeline.record_start(self.step, self.world_size, self.accumulation, resumed is not None)
            self.redone_steps = self.timeline.redone_steps_total()
            if row["event"] != "start":
                self.log_line(f"{row['event']}: world size {self.world_size} x accumulation {self.accumulation} "
                              f"from optimizer step {self.step}; {row['redone_steps']} step(s) done since that "
                              f"checkpoint are redone ({self.redone_steps} redone in this run so far)")
        if self.world_size > 1:
            self.model = wrap_ddp(self.raw_model, self.device)
        order = D.RankOrder(None, cfg.seed, self.steps_per_epoch, cfg.global_batch_size, self.world_size,
                            self.rank, self.step, num_sequences=self.data.num_sequences, val_samples=cfg.val_samples)
        self.batches = self.launcher.batches(order, self.total_steps)

    def restore(self) -> dict | None:
        """Load every stateful component from the checkpoint this run continues; return its state.json."""
        resume = self.checkpoints.load()
        if resume is None:
            return None
        s = resume.state
        C.check_resume(s, self.checkpoints.resumed_from, self.model_cfg, self.train_cfg, self.data.fingerprint,
                       allow_config_change=True)  # the entry point refused a change that was not allowed
        for name, then in C.PREDATED_VALUES.items():
            if name not in s["train_config"] and name not in self.train_cfg.inert() and \
                    getattr(self.train_cfg, name) != then:
                self.log_line(f"note: {Path(self.checkpoints.resumed_from).name} predates "
                              f"--{name.replace('_', '-')}: the run goes on with its {name} {then}")
                setattr(self.train_cfg, name, then)
        self.raw_model.load_state_dict(resume.model_state, strict=True)
        # The loaded param groups carry the saved betas / weight decay; this run's config (as predated above) wins.
        configured = [{k: v for k, v in g.items() if k != "params"}
                      for g in S.make_optimizer(self.raw_model, self.train_cfg).param_groups]
        self.optimizer.load_state_dict(resume.optimizer_state)
        for group, settings in zip(self.optimizer.param_groups, configured, strict=True):
            group.update(settings)
        self.scaler.load_state_dict(resume.scaler_state)
        self.guard.load_state_dict(s["nonfinite_guard"])
        self.step, self.run_id = int(s["optimizer_step"]), s.get("run_id", self.run_id)
        self.checkpoints.index, self.checkpoints.cadence.last_step = int(s.get("checkpoint_index", 0)), self.step
        return s

    def fit(self) -> str:
        """Train to the last step: "finished", or "exited" (--exit-after-*); or raise Preempted, NonFiniteLossError,
        CheckpointError (on every rank, at the same step)."""
        self.peak = None  # MFU's denominator, measured at the first log: a start is busy (Ray, the data pipeline)
        cfg, policy = self.train_cfg, self.loop_policy()
        self.meter = Meter(self.step, self.total_steps, self.batches.data_wait_s, self.mfu)
        try:
            for micro_batches, _sample_ids in self.batches:
                torch.manual_seed(cfg.seed * 1_000_003 + self.step * 1009 + self.rank)  # dropout RNG: a function of the step
                lr = get_lr(self.step, self.total_steps, cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio,
                            cfg.schedule, cfg.decay_fraction)
                m = self.optimizer_step(self.model, self.optimizer, self.scaler, micro_batches, lr=lr,
                                        grad_clip=cfg.grad_clip, dtype=self.dtype, shares=self.shares,
                                        world_size=self.world_size)
                self.step += 1
                self.guard.update(m, self.step, self.scaler.is_enabled())
                self.meter.tokens += cfg.global_batch_size * cfg.seq_len
                decision = policy.after_step(self.step)
                if decision.log:
                    metrics = self.log(m, lr, decision.evaluate)
                    state = self.checkpoint_state(metrics) if decision.checkpoint else None
                    self.checkpoints.report(self.step, metrics, model=self.raw_model, optimizer=self.optimizer,
                                            scaler=self.scaler, state=state, final=decision.final)
                    self.meter.restart(self.batches.data_wait_s)  # evaluation and checkpoint time stay out of it
                if decision.stop:
                    return self.stop(decision)
            self.record("finish")
            self.await_last_scores()
            return "finished"
        finally:
            policy.close()
            self.checkpoints.close()  # a save in flight is finished (or fails) before the process goes

    def loop_policy(self) -> LoopPolicy:
        run = self.run
        return LoopPolicy(self.collectives, self.checkpoints, total_steps=self.total_steps, log_every=self.train_cfg.log_every,
                          eval_every=(self.train_cfg.eval_every or self.train_cfg.checkpoint_every)
                          if self.val_ids is not None else None, stop_flags=self.launcher.stop_flags,
                          nonfinite=self.guard.tripped, on_nonfinite=self.guard.check,
                          exit_after_steps=run.exit_after_steps, exit_after_minutes=run.exit_after_minutes,
                          started_at=run.started_at)

    def stop(self, decision) -> str:
        """After the checkpoint of a stop: Preempted (for a restart), or "exited"."""
        self.record("preempt" if decision.preempt else "exit")
        if decision.preempt:
            message = f"{decision.stop} at optimizer step {self.step}: checkpoint written, exiting for a restart"
            self.log_line(message)
            raise Preempted(message)
        self.log_line(f"exiting after optimizer step {self.step} as asked "
                      f"(--exit-after-steps/--exit-after-minutes); continue with --resume auto")
        return "exited"

    def log(self, m, lr: float, evaluating: bool) -> dict:
        """Every rank: this log step's metrics; rank 0 also prints them and writes metrics.jsonl and the trackers."""
        metrics = self.step_metrics(m, lr)
        if evaluating:
            metrics.update(self.validate())
        self.history.append(metrics)
        if self.rank == 0:
            self.log_line(format_log_line(metrics))
            if self.metrics_log:
                self.metrics_log.append({**metrics, "time": time.time(), "run_id": self.run_id})
            self.trackers.log(metrics, step=self.step)
            if self.timeline:
                self.timeline.step_done(self.step)
            if self.eval_inbox:  # scores of earlier checkpoints, if any arrived: never waited for
                self.forward_scores(self.eval_inbox.poll(self.step))
                return {**metrics, **self.eval_inbox.latest}  # in Ray's report too: Tune, the dashboard
        return metrics

    def forward_scores(self, records: list[dict]) -> None:
        """Scores of checkpoints evaluated beside training, each at its checkpoint's step (minilm.eval_log)."""
        for record in records:
            self.metrics_log.append({**record, "time": time.time(), "run_id": self.run_id})
            self.trackers.log_eval({k: v for k, v in record.items() if k.startswith("eval/")},
                                   step=record["optimizer_step"])

    def await_last_scores(self) -> None:
        """With checkpoints scored beside training: rank 0 waits for the last one's scores, then every rank reports once
        more (a barrier) so that they reach Ray."""
        if not self.run.eval_task_names or not self.history:  # (no step run: the run had already ended)
            return
        if self.eval_inbox:
            wait_s = self.run.eval_wait_s
            # the run folder's checkpoints (pruning keeps those not scored yet), the last one among them
            steps = sorted({int(n.split("_")[1]) for n in self.checkpoints.folder.checkpoints()} | {self.step})
            if not self.eval_inbox.scored(steps):
                self.log_line(f"waiting up to {wait_s / 60:g} min for the scores of the last checkpoint "
                              f"(step {self.step})")
            self.forward_scores(self.eval_inbox.wait_for(steps, wait_s))
            if not self.eval_inbox.scored(steps):
                self.log_line(f"note: the last checkpoint (step {self.step}) was not scored within {wait_s / 60:g} "
                              f"min; its scores go to {self.eval_inbox.path} when the evaluation ends")
        self.checkpoints.report(self.step, {**self.history[-1], **(self.eval_inbox.latest if self.eval_inbox else {})})

    def step_metrics(self, m, lr: float) -> dict:
        """The window's losses averaged over ranks (each weighted by its slice), the position, the rates."""
        cfg, step, spe = self.train_cfg, self.step, self.steps_per_epoch
        losses = self.collectives.sum(torch.stack([m.loss, m.lm_loss, m.aux_loss]).float() * m.share).tolist()
        samples_seen = D.DataPosition.at(step, spe, cfg.global_batch_size).samples_seen
        metrics = {
            "loss": losses[0], "lm_loss": losses[1], "aux_loss": losses[2], "lr": lr, "grad_norm": float(m.grad_norm),
            **self.meter.rates(step, self.batches.data_wait_s),
            "optimizer_step": step, "total_steps": self.total_steps, "samples_seen": samples_seen,
            "tokens_seen": samples_seen * cfg.seq_len, "epoch": (step - 1) // spe, "epochs": -(-self.total_steps // spe),
            "world_size": self.world_size, "accumulation_steps": self.accumulation,
            "skipped_steps": int(self.guard.skipped_total), "checkpoint_s": self.checkpoints.save_s,
            "checkpoint_wait_s": self.checkpoints.wait_s, "redone_steps": self.redone_steps,
            **cuda_peak_memory(self.device),  # this rank's GPU
        }
        if self.raw_model.config.use_moe:
            metrics["expert_load"] = [[round(float(x), 4) for x in layer] for layer in self.raw_model.expert_load()]
        return metrics

    def mfu(self, tokens_per_s: float) -> float:
        if self.peak is None:  # between the interval's end and the loop's restart of it: not training time
            self.peak = peak_flops(self.device, self.dtype)
        return self.raw_model.estimate_mfu(tokens_per_s / self.world_size, self.train_cfg.seq_len, self.peak)

    def checkpoint_state(self, metrics: dict) -> dict:
        """state.json: the position (optimizer step) and what a resume must match."""
        cfg = self.train_cfg
        pos = D.DataPosition.at(self.step, self.steps_per_epoch, cfg.global_batch_size)
        return {
            "optimizer_step": self.step, "epoch": pos.epoch, "samples_seen": pos.samples_seen,
            "world_size": self.world_size, "micro_batch_size": self.micro_batch_size,
            "accumulation_steps": self.accumulation, "global_batch_size": cfg.global_batch_size,
            "total_steps": self.total_steps, "model_config": self.model_cfg.to_dict(), "train_config": cfg.to_dict(),
            "data_fingerprint": self.data.fingerprint, "tokenizer_sha256": self.data.tokenizer_sha256,
            "run_id": self.run_id, "run_name": self.run.name, "nonfinite_guard": self.guard.state_dict(),
            "trackers": self.trackers.state_dict(), "loss": metrics["loss"],
        }

    @torch.no_grad()
    def validate(self) -> dict:
        """val_loss and val_bpb (minilm.bpb) of the held-out rows: each rank scores every W-th row, sums added."""
        model, m = self.raw_model, self.micro_batch_size
        if self.token_bytes is None:  # the UTF-8 bytes each token id spells; False without a byte-level BPE
            self.token_bytes = False
            with contextlib.suppress(ValueError, OSError, KeyError):
                if self.data.tokenizer_path is not None:
                    self.token_bytes = torch.as_tensor(token_byte_lengths(self.data.tokenizer_path), device=self.device)
        model.eval()
        # nats over all targets, targets, nats over targets that spell text, their bytes
        total = torch.zeros(4, dtype=torch.float64, device=self.device)
        for start in range(0, len(self.val_ids), m):
            rows = torch.from_numpy(np.ascontiguousarray(self.data.store.take(self.val_ids[start:start + m])))
            rows = rows.to(self.device).long()
            with S.autocast(self.device.type, self.dtype):  # seq_len positions fed and scored, the head in chunks
                nats = model(rows[:, :-1], targets=rows[:, 1:], reduction="none").loss.flatten()
            targets = rows[:, 1:].reshape(-1)
            total[0] += nats.sum()
            total[1] += nats.numel()
            if self.token_bytes is not False:
                nbytes = self.token_bytes[targets]
                total[2] += (nats * (nbytes > 0)).sum()
                total[3] += nbytes.sum()
        model.train()
        nats_all, targets, nats_text, nbytes = self.collectives.sum(total).tolist()
        result = {"val_loss": nats_all / targets}
        if nbytes > 0:
            result["val_bpb"] = bits_per_byte(nats_text, nbytes)
        return result

    def uneven(self) -> str:
        """The start line's note when the world size does not divide the global batch."""
        g, w = self.train_cfg.global_batch_size, self.world_size
        return f" (uneven: each rank takes {-(-g // w)} or {g // w} of the {g} sequences)" if g % w else ""

    def record(self, event: str) -> None:
        if self.timeline:
            self.timeline.record(self.step, self.world_size, self.accumulation, event)

    def log_line(self, message: str) -> None:
        if self.rank == 0:
            self.launcher.say(message)

    def close(self, outcome: str) -> None:
        self.trackers.close(outcome)


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DDP without buffer broadcasts (RoPE tables are the same everywhere, MoE load is per rank), gradients as views
    into its buckets (a copy and its memory saved)."""
    ddp = torch.nn.parallel.DistributedDataParallel
    no_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in inspect.signature(ddp.__init__).parameters
               else {"broadcast_buffers": False})  # torch < 2.13
    return ddp(model, device_ids=[device] if device.type == "cuda" else None, gradient_as_bucket_view=True,
               **no_sync)

