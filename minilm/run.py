"""The run plan: how every launcher (`minilm.train`, `ray_jobs.pretrain`, a Tune sweep) starts a run. Every check
first, then the side effects: a refused command changes nothing in the run folder (docs/architecture.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import checkpoint as C
from .config import ModelConfig, TrainConfig, check_fits
from .options import Configs, RunOptions, StepPlan, check_configs, dump_yaml, plan_steps
from .safety import check_name, redact
from .trackers import check_trackers

CONFIG = "config.yaml"  # RUN/config.yaml: the effective config of the run's latest start, a --config file


@dataclass
class RunPlan:
    """A run checked and ready to start: configs, options, its data and steps, and (after `claim`) its run folder's
    lease and the state of the checkpoint it continues."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    opts: RunOptions
    data: Any  # what the launcher opened: minilm.data.PreparedData or minilm.trainer.Dataset (num_sequences)
    steps: StepPlan
    notes: list[str] = field(default_factory=list)  # shown under the start line
    eval_tasks: list = field(default_factory=list)  # --eval-tasks, read and checked (minilm.tasks.Task)
    folder: C.RunFolder | None = None
    lease: C.Lease | None = None
    state: dict | None = None  # state.json of the checkpoint a fresh start continues

    @property
    def run_dir(self) -> Path | None:
        return Path(self.opts.run_dir) if self.opts.run_dir else None

    def release(self) -> None:
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class Launch:
    """What differs between launchers; `plan_run` calls these in this order. Checks raise; only `act` has effects."""

    writes_config = True  # RUN/CONFIG at each start (a sweep's folder: no, each trial's has one)

    def check(self, model_cfg: ModelConfig, train_cfg: TrainConfig, opts: RunOptions) -> None:
        """The launcher's own flags, before any data is opened."""

    def open_data(self, model_cfg: ModelConfig, train_cfg: TrainConfig, opts: RunOptions, notes: list[str]):
        """The data, opened and checked against the configs (`num_sequences`, `fingerprint`)."""
        raise NotImplementedError

    def world_sizes(self, opts: RunOptions) -> range:
        return range(1, 2)

    def check_cluster(self, plan: RunPlan) -> None:
        """Where the run will execute (Ray's launcher: the cluster, its resources, the evaluation tasks)."""

    def folder(self, opts: RunOptions) -> C.RunFolder | None:
        """The run folder this command holds the lease of, or None (nothing kept)."""
        return None

    def resolve(self, plan: RunPlan) -> None:
        """Settle --dtype auto and --optimizer auto once for every rank, given the checkpoint it continues
        (`plan.state`: a resume keeps its dtype, and check_origin gave it the checkpoint's optimizer)."""

    def act(self, plan: RunPlan) -> None:
        """The launcher's own side effects, once every check has passed."""


DRY_RUN = "dry run: every check passed; nothing was started or written"  # --dry-run's last line, exit 0


def plan_run(configs: Configs, launch: Launch, say=print) -> RunPlan:
    """Every check of a run, then (the whole run folder's lease held) its side effects; a RunPlan holding the lease."""
    plan = check_run(configs, launch)
    claim(plan, launch, say)
    return plan


def check_run(configs: Configs, launch: Launch) -> RunPlan:
    """Every check that needs no run folder and no cluster; nothing is written."""
    model_cfg, train_cfg, opts = configs
    check_configs(model_cfg, train_cfg, opts)
    if opts.name is not None:
        check_name(opts.name, "--name")
    launch.check(model_cfg, train_cfg, opts)
    notes: list[str] = []
    data = launch.open_data(model_cfg, train_cfg, opts, notes)
    check_fits(model_cfg, train_cfg)  # again: the data's manifest may have set seq_len (data.fit_configs)
    where = f"{redact(data.location)}: " if hasattr(data, "location") else ""  # PreparedData's, maybe a URI
    steps = plan_steps(train_cfg, data.num_sequences, launch.world_sizes(opts), where=where)
    opts.trackers = check_trackers(opts.tracker, opts.tracker_settings(), run_dir=opts.run_dir)
    return RunPlan(model_cfg, train_cfg, opts, data, steps, [n for n in notes if n])


def claim(plan: RunPlan, launch: Launch, say=print) -> None:
    """Under the run folder's lease (taken first, before any cluster is joined): the resume, cluster and origin
    checks, then --abandon-newer's move and the launcher's effects. Refused: the lease (and any folder it made) goes.
    --dry-run: the same checks, the lease read but not taken, and none of the effects."""
    opts = plan.opts
    plan.folder = launch.folder(opts)
    lease = C.Lease(plan.folder, say) if plan.folder is not None else None
    if lease is not None and opts.dry_run:
        lease.check(writable=True)  # a folder a live run holds is refused; nothing is written
    elif lease is not None:
        plan.lease = lease.take()
    try:
        decision = C.decide_resume(plan.folder, opts.resume, opts.abandon_newer)
        opts.resume_path = decision.origin
        launch.check_cluster(plan)
        plan.state = C.check_origin(plan.folder, decision.origin, plan.model_cfg, plan.train_cfg,
                                    plan.data.fingerprint, opts.allow_config_change, say)
        if opts.dry_run:  # the precision and optimizer (probes that time), the move and the launcher's effects: no checks
            return
        plan.train_cfg.dtype = C.resumed_dtype(plan.train_cfg.dtype, plan.state)
        launch.resolve(plan)
        decision.apply(plan.folder, say)
        launch.act(plan)
        if plan.folder is not None and launch.writes_config:
            write_config(plan)
    except BaseException:
        plan.release()
        raise


def write_config(plan: RunPlan, folder: C.RunFolder | None = None) -> None:
    """RUN/config.yaml (`folder`'s, else the plan's): this start's configs, for --config; each start rewrites it."""
    header = f"# run {plan.opts.name}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: reuse with --config (flags win)\n"
    (folder or plan.folder).write(CONFIG, dump_yaml(plan.model_cfg, plan.train_cfg, plan.opts, header).encode())
