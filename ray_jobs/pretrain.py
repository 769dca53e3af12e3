"""Pretrain a MiniMind-class model with Ray Train.

    python -m ray_jobs.pretrain                                   # small model, built-in corpus, local Ray
    python -m ray_jobs.pretrain --data data/tok --num-workers 2-8 --name run1 --storage-path s3://bucket/runs
    ray job submit --working-dir . -- python -m ray_jobs.pretrain --name run1 --resume auto

Every ModelConfig / TrainConfig field is a flag (--hidden-size, --global-batch-size, ...), and
`--config FILE.yaml` sets any of them (flags win). Checkpoints are Ray Train checkpoints under
STORAGE/NAME; `--resume auto` continues the latest complete one, from any driver process, at any
world size that keeps the global batch.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from minilm import checkpoint as C
from minilm import data as D
from minilm import testing
from minilm.cli import (
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    UsageError,
    add_config_flags,
    build_configs,
    fail,
    load_yaml,
)
from minilm.config import ConfigError, ModelConfig, TrainConfig, check_fits, valid_world_sizes
from minilm.distributed import collective_timeout_s
from minilm.progress import MetricsLog, format_duration
from minilm.rows import rows_note
from minilm.timeline import TIMELINE, WorldSizeTimeline, format_timeline
from minilm.trackers import TrackerError, check_trackers

from .cli import available_cores, ensure_ray, parse_num_workers
from .elastic import SHARED_STORAGE_HINT, nodes_missing_path
from .ray_compat import CONTROLLER_POLL_ENV

RUN_KEYS = {"data", "num_workers", "use_gpu", "cpus_per_worker", "storage_path", "name", "resume", "max_failures",
            "keep_checkpoints", "exit_after_steps", "exit_after_minutes", "val_samples", "collective_timeout_s",
            "num_cpus", "elastic_check_seconds", "eval_every", "resources_per_worker", "tracker", "mlflow_uri",
            "wandb_project", "allow_config_change"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ray_jobs.pretrain", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="YAML file of option: value (any flag below, underscores or dashes)")
    r = p.add_argument_group("run")
    r.add_argument("--data", help="prepared data dir (ray_jobs.prepare); default: the built-in demo corpus, "
                                  "prepared once into ~/.cache/minilm")
    r.add_argument("--num-workers", help="N, or MIN-MAX for an elastic run (default 2)")
    r.add_argument("--use-gpu", choices=["auto", "true", "false"], help="default auto: GPUs if the cluster has any")
    r.add_argument("--cpus-per-worker", help="CPUs (and torch threads) per worker, or auto (default): on a local Ray "
                                              "started by this command, the machine's cores divided among the "
                                              "workers; on a cluster, a node's CPUs divided among the workers it "
                                              "would host (GPU runs: its CPUs per GPU)")
    r.add_argument("--resources-per-worker", metavar="NAME=N[,NAME=N]",
                   help="custom Ray resources each worker also needs, e.g. spot_slot=1 (one worker per node that "
                        "offers one)")
    r.add_argument("--storage-path", help="local path or pyarrow URI (s3://, gs://); default ./runs")
    r.add_argument("--name", help="run name; resume finds checkpoints by it (default: minilm-<time>)")
    r.add_argument("--resume", help="auto (default): continue RUN's latest complete checkpoint; never; or a "
                                    "checkpoint PATH")
    r.add_argument("--max-failures", type=int, help="worker-group restarts Ray Train may do (default 0)")
    r.add_argument("--keep-checkpoints", type=int, help="CheckpointConfig(num_to_keep) (default 3)")
    r.add_argument("--exit-after-steps", type=int, help="checkpoint and exit cleanly after this optimizer step")
    r.add_argument("--exit-after-minutes", type=float, help="checkpoint and exit cleanly after this many minutes")
    r.add_argument("--val-samples", type=int, help="held-out sequences for val_loss and val_bpb (default 0: no "
                                                    "validation)")
    r.add_argument("--eval-every", type=int, help="optimizer steps between val_loss evaluations "
                                                   "(default: --checkpoint-every)")
    r.add_argument("--elastic-check-seconds", type=float, help="how often Ray checks to resize an elastic run")
    r.add_argument("--collective-timeout-s", "--backend-timeout-s", type=float, dest="collective_timeout_s",
                   help="seconds a rank waits in one collective for the others before its worker fails (a rank hung "
                        "or gone; with --max-failures the group restarts from the last checkpoint); default 600 on "
                        "GPUs (NCCL), 1800 on CPUs (gloo)")
    r.add_argument("--num-cpus", type=int, help="logical CPUs of a local Ray (default max(8, 2 x cores))")
    r.add_argument("--tracker", action="append", metavar="none|tensorboard|mlflow|wandb",
                   help="experiment tracker(s) rank 0 logs every reported metric to (repeat, or comma-separate); "
                        "the tracker run continues across resumes (docs/tracking.md)")
    r.add_argument("--mlflow-uri", help="MLflow tracking URI (default: sqlite:///RUN_DIR/mlflow.db)")
    r.add_argument("--wandb-project", help="W&B project (default minilm); WANDB_MODE=offline works")
    r.add_argument("--allow-config-change", action="store_true", default=None,
                   help="resume even though the schedule or optimizer settings differ from the checkpoint's "
                        "(lr, warmup, steps, betas, weight decay, ...): each change is logged and used")
    add_config_flags(p)
    return p


RUN_DEFAULTS = {"num_workers": "2", "use_gpu": "auto", "cpus_per_worker": "auto", "storage_path": "./runs",
                "resume": "auto", "max_failures": 0, "keep_checkpoints": 3, "val_samples": 0,
                "elastic_check_seconds": 60.0}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (UsageError, ConfigError, D.DataError, C.CheckpointError, TrackerError) as e:
        return fail(str(e))
    except KeyboardInterrupt:
        return fail("interrupted; continue with --resume auto and the same --name", EXIT_INTERRUPTED)


@dataclass
class RunPlan:
    """A run checked and ready to start: configs, options, where it writes, what it reads."""

    model_cfg: ModelConfig
    train_cfg: TrainConfig
    opts: dict
    workers: tuple[int, int]
    name: str
    storage: str
    run_dir: Path | None
    data_dir: Path | str  # a local folder, or a remote URI every node copies once
    prepared: D.PreparedData
    steps_per_epoch: int
    resume_path: Path | None = None
    hooks: testing.FaultHooks | None = None  # only when a test switched fault injection on
    notes: list[str] = field(default_factory=list)  # shown under the start line

    def config(self, name: str | None = None, run_dir: Path | None | str = "same") -> dict:
        """The train_loop_config every worker gets."""
        name = name or self.name
        run_dir = self.run_dir if run_dir == "same" else run_dir
        return {
            "model": self.model_cfg.to_dict(), "train": self.train_cfg.to_dict(),
            "run": {"name": name, "run_id": f"{name}-{int(time.time())}", "data_dir": str(self.data_dir),
                    "run_dir": str(run_dir) if run_dir else None, "val_samples": self.opts["val_samples"],
                    "storage_dir": f"{self.storage.split('?', 1)[0].rstrip('/')}/{name}",
                    "collective_timeout_s": self.opts.get("collective_timeout_s"),
                    "eval_every": self.opts.get("eval_every") or self.train_cfg.checkpoint_every,
                    "resume_path": str(self.resume_path) if self.resume_path else None,
                    "exit_after_steps": self.opts.get("exit_after_steps"),
                    "exit_after_minutes": self.opts.get("exit_after_minutes"),
                    "trackers": self.opts.get("trackers", []), "tracker_options": tracker_options(self.opts),
                    "test_hooks": self.hooks.to_dict() if self.hooks else None},
        }


def check_options(model_cfg: ModelConfig, train_cfg: TrainConfig, opts: dict) -> tuple[int, int]:
    """Every check that needs no data and no Ray; returns the (min, max) world size."""
    model_cfg.validate()
    train_cfg.validate()  # the config's own problems first, then how it meets the world size
    min_w, max_w = parse_num_workers(opts["num_workers"])
    valid = valid_world_sizes(train_cfg.global_batch_size, train_cfg.micro_batch_size)
    bad = [w for w in range(min_w, max_w + 1) if w not in valid]
    if bad:
        raise UsageError(f"--num-workers {opts['num_workers']}: world size(s) {', '.join(map(str, bad))} cannot keep "
                         f"global_batch_size {train_cfg.global_batch_size} with micro_batch_size "
                         f"{train_cfg.micro_batch_size}; valid world sizes: {', '.join(map(str, valid)) or 'none'}")
    train_cfg.validate(world_size=min_w)
    check_fits(model_cfg, train_cfg)
    for key in ("max_failures", "keep_checkpoints", "val_samples"):
        if not isinstance(opts[key], int) or opts[key] < (1 if key == "keep_checkpoints" else 0):
            raise UsageError(f"{'--' + key.replace('_', '-')} must be an integer >= "
                             f"{1 if key == 'keep_checkpoints' else 0}, got {opts[key]!r}")
    for key in ("eval_every", "exit_after_steps"):
        if opts.get(key) is not None and opts[key] < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be >= 1")
    if opts.get("exit_after_minutes") is not None and not opts["exit_after_minutes"] > 0:
        raise UsageError("--exit-after-minutes must be > 0")
    if opts.get("collective_timeout_s") is not None and not opts["collective_timeout_s"] >= 1:
        raise UsageError(f"--collective-timeout-s must be >= 1, got {opts['collective_timeout_s']}")
    if str(opts["cpus_per_worker"]) != "auto":
        given = opts["cpus_per_worker"]
        try:
            opts["cpus_per_worker"] = float(given)
        except ValueError:
            opts["cpus_per_worker"] = -1.0
        if not opts["cpus_per_worker"] > 0:
            raise UsageError(f"--cpus-per-worker must be auto or a number > 0, got {given!r}")
    opts["resources_per_worker"] = parse_resources(opts.get("resources_per_worker"))
    return min_w, max_w


def parse_resources(spec) -> dict[str, float]:
    """'slot=1,disk=2' (or a YAML mapping) -> {'slot': 1.0, 'disk': 2.0}."""
    if not spec:
        return {}
    items = spec.items() if isinstance(spec, dict) else (part.partition("=")[::2] for part in str(spec).split(","))
    resources = {}
    for name, value in items:
        name = str(name).strip()
        try:
            amount = float(value)
        except (TypeError, ValueError):
            amount = -1.0
        if not name or amount <= 0 or name in ("CPU", "GPU"):
            raise UsageError(f"--resources-per-worker {spec!r}: expected NAME=N with N > 0, e.g. slot=1 "
                             f"(CPU and GPU have their own flags: --cpus-per-worker, --use-gpu)")
        resources[name] = amount
    return resources


def plan_run(args: argparse.Namespace, extra_keys: frozenset[str] = frozenset(), concurrent_runs: int = 1,
             reserved_cpus: float = 0.0) -> RunPlan:
    """Flags + YAML -> a checked RunPlan (starts or joins Ray, prepares the demo data if needed).
    `concurrent_runs`: runs sharing the machine at once (Tune trials), and `reserved_cpus` the CPUs other actors
    of theirs hold (Tune's trial functions), for --cpus-per-worker auto."""
    file_values = load_yaml(args.config)
    demo = not (args.data or file_values.get("data"))
    configs = build_configs(args, file_values, RUN_KEYS | extra_keys, demo=demo)
    model_cfg, train_cfg, rest = configs
    opts = {**RUN_DEFAULTS, **rest}
    hooks = testing.from_env(warn=lambda m: print(m, file=sys.stderr, flush=True))
    min_w, max_w = check_options(model_cfg, train_cfg, opts)

    name = opts.get("name") or time.strftime("minilm-%Y%m%d-%H%M%S")
    storage = opts["storage_path"]
    local_storage = "://" not in storage
    if local_storage:
        storage = str(Path(storage).expanduser().resolve())
    run_dir = Path(storage) / name if local_storage else None

    resume_path = None
    if opts["resume"] not in ("auto", "never"):
        resume_path = Path(opts["resume"]).expanduser().resolve()
        C.verify(resume_path, once_per_node=True)  # missing, partial or corrupt: refused here, before any worker starts
        if C.checkpoint_dirs(run_dir):
            raise UsageError(f"run {name} already has checkpoints in {run_dir}: --resume {resume_path} would mix two "
                             f"runs; use another --name (or --resume auto to continue {name})")
    elif opts["resume"] == "never" and run_dir is not None and any(run_dir.glob("checkpoint_*")):
        raise UsageError(f"run {name} already has checkpoints in {run_dir}; use --resume auto to continue it, "
                         f"or another --name")

    opts["trackers"] = check_trackers(opts.get("tracker"), tracker_options(opts), run_dir=run_dir)
    if local_storage:
        check_storage_writable(Path(storage))
    if not demo:
        data_dir = opts["data"] if D.is_remote(opts["data"]) else Path(opts["data"]).expanduser().resolve()
        D.open_prepared(data_dir)  # a missing, incomplete or damaged --data is refused before Ray starts
    started_here = ensure_ray(opts.get("num_cpus"))
    if opts["cpus_per_worker"] == "auto":
        opts["cpus_per_worker"] = auto_cpus_per_worker(max_w * concurrent_runs, started_here, opts, reserved_cpus)
    if local_storage:
        missing = nodes_missing_path(Path(storage))
        if missing:
            raise UsageError(f"--storage-path {storage} is not visible from {len(missing)} node(s) of this cluster "
                             f"({', '.join(missing)}): {SHARED_STORAGE_HINT}")
    if train_cfg.dtype == "fp16" and not uses_gpu(opts):
        raise UsageError("--dtype fp16 needs GPU workers (CPU autocast supports bf16 or fp32); this run has none: "
                         "use --dtype bf16, fp32 or auto")
    if demo:
        from .demo_data import demo_data_dir

        data_dir = demo_data_dir(train_cfg.seq_len, model_cfg.vocab_size)
    prepared = D.open_prepared(data_dir)
    D.check_compatible(prepared, vocab_size=model_cfg.vocab_size, seq_len=train_cfg.seq_len)
    notes = [rows_note(prepared.manifest, prepared.location)]
    train_ids, _ = D.split_ids(prepared.num_sequences, opts["val_samples"])
    per_epoch = D.steps_per_epoch(len(train_ids), train_cfg.global_batch_size)
    if per_epoch == 0:
        raise D.DataError(f"{data_dir}: {len(train_ids)} training sequences do not fill one global batch of "
                          f"{train_cfg.global_batch_size}")
    train_cfg.validate(world_size=min_w, total_steps=train_cfg.max_steps or per_epoch * train_cfg.epochs)
    if resume_path is None:  # --resume auto: what the workers continue when Ray has no checkpoint of the run registered
        resume_path = latest_checkpoint(run_dir, opts["resume"])
    saved = check_resumable(resume_path, model_cfg, train_cfg, prepared, opts)
    train_cfg.dtype = run_dtype(train_cfg.dtype, saved, opts)  # one precision for every rank and every restart
    if hooks and hooks.record_sample_ids:
        Path(hooks.record_sample_ids).mkdir(parents=True, exist_ok=True)
    return RunPlan(model_cfg=model_cfg, train_cfg=train_cfg, opts=opts, workers=(min_w, max_w), name=name,
                   storage=storage, run_dir=run_dir, data_dir=data_dir, prepared=prepared, steps_per_epoch=per_epoch,
                   resume_path=resume_path, hooks=hooks, notes=[n for n in notes if n])


def auto_cpus_per_worker(workers: int, local: bool, opts: dict, reserved_cpus: float = 0.0) -> float:
    """--cpus-per-worker auto. A local Ray this command started: the machine's cores divided among the workers
    (at least 1), so 1 worker on a laptop uses every core. A running cluster: the CPUs of its smallest node that
    can host a worker, less one left for Ray Data and Ray itself (workers that take every CPU starve the tasks
    that feed them) and less the CPUs other actors of the runs reserve (Tune's trial functions: counted whole, on
    every node, since they go wherever Tune puts them), divided among the workers such a node would host if they
    spread evenly (GPU runs: one worker per GPU). A local Ray's logical CPUs are not used: it declares more than
    there are cores (ensure_ray)."""
    if local:
        return float(max(1, available_cores() // max(1, workers)))
    import ray

    custom = opts["resources_per_worker"]
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) >= 1
             and all(n["Resources"].get(k, 0) >= v for k, v in custom.items())]
    if uses_gpu(opts):
        per_gpu = [(r["CPU"] - 1) // r["GPU"] for r in nodes if r.get("GPU", 0) >= 1]
        return float(max(1, int(min(per_gpu)))) if per_gpu else 1.0
    if not nodes:
        return 1.0
    per_node = -(-workers // len(nodes))
    return float(max(1, int(min(r["CPU"] for r in nodes) - 1 - math.ceil(reserved_cpus)) // per_node))


def check_storage_writable(storage: Path) -> None:
    """A local --storage-path that cannot be created or written is one error line here, not a traceback from
    Ray's controller later."""
    created = [p for p in (storage, *storage.parents) if not p.exists()]
    try:
        storage.mkdir(parents=True, exist_ok=True)
        probe = storage / f".minilm-write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise UsageError(f"--storage-path {storage}: cannot create or write there "
                         f"({e.strerror or e}); choose a writable folder or an s3:// / gs:// URI") from None
    finally:
        for folder in created:  # a check leaves nothing behind: the run creates its folders when it starts
            try:
                folder.rmdir()
            except OSError:
                break


def tracker_options(opts: dict) -> dict:
    return {"mlflow_uri": opts.get("mlflow_uri"), "wandb_project": opts.get("wandb_project"),
            "group": opts.get("tracker_group")}


def latest_checkpoint(run_dir: Path | None, resume: str) -> Path | None:
    """The newest complete (verified) checkpoint in a local run folder, for --resume auto.

    Ray Train registers a checkpoint in its run state only after every rank's report reached the
    controller; a driver killed after the upload but before that leaves a complete checkpoint that
    `ray.train.get_checkpoint()` does not know, and the run would start fresh. The workers continue
    this one when Ray has none registered. A folder torn by a kill mid-upload is skipped, with a message.
    """
    if run_dir is None or resume != "auto":
        return None
    return C.latest_complete(C.checkpoint_dirs(run_dir), once_per_node=True)  # a worker on this node: no rehash


def check_resumable(path: Path | None, model_cfg: ModelConfig, train_cfg: TrainConfig, prepared,
                    opts: dict) -> dict | None:
    """Refuse, before any worker starts, a run that cannot continue the checkpoint it would resume, or that
    would silently change it; returns the checkpoint's state.json."""
    if path is None:
        return None
    state = C.read_state(path)
    problems = C.resume_problems(state, model_cfg, train_cfg.global_batch_size, train_cfg.seed, prepared.fingerprint,
                                 dtype=train_cfg.dtype, optimizer=train_cfg.optimizer)
    if problems:
        raise UsageError(f"cannot resume from {path}: " + "; ".join(problems) +
                         " (use another --name to start a new run)")
    changes = C.config_changes(state, train_cfg, val_samples=opts["val_samples"])
    refused = [c for c in changes if not c.safe]
    if refused and not opts.get("allow_config_change"):
        raise UsageError(f"cannot resume from {path} with other settings: " + "; ".join(map(str, refused)) +
                         " change the schedule or optimizer mid-run; pass --allow-config-change to continue with "
                         "the new values, or use another --name")
    for c in changes:
        print(f"note: resuming with {c}" + ("" if c.safe else " (--allow-config-change)"), flush=True)
    return state


def run_dtype(requested: str, saved: dict | None, opts: dict) -> str:
    """The one precision of the run, decided here before any worker starts: the checkpoint's when resuming
    (`auto`, or a change `config_changes` let through), else `--dtype`, with `auto` probed once on a worker-like
    process (bf16 on GPUs that support it; on CPUs, bf16 only where its matmuls are faster)."""
    if saved is not None:
        before = C.checkpoint_dtype(saved)
        if before and (requested == "auto" or requested == before):
            return before
    if requested != "auto":
        return requested
    return probe_dtype(opts)


def probe_dtype(opts: dict) -> str:
    """Resolve `--dtype auto` in one Ray task placed like a training worker (GPU, CPUs, custom resources)."""
    import ray

    from minilm.step import resolve_dtype

    use_gpu = uses_gpu(opts)

    @ray.remote(num_cpus=0.01 if use_gpu else max(0.01, float(opts["cpus_per_worker"])), num_gpus=1 if use_gpu else 0,
                resources=opts["resources_per_worker"] or None)
    def probe() -> str:
        import torch

        dtype = resolve_dtype("auto", "cuda" if use_gpu else "cpu")
        return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]

    try:
        return ray.get(probe.remote(), timeout=180)
    except ray.exceptions.GetTimeoutError:
        fallback = "bf16" if use_gpu else "fp32"
        print(f"warning: no worker-like slot free within 3 minutes to probe --dtype auto: using {fallback} "
              f"(set --dtype to choose)", file=sys.stderr, flush=True)
        return fallback


def run(args: argparse.Namespace) -> int:
    plan = plan_run(args)
    trainer = make_trainer(plan.config(), plan.opts, plan.storage, plan.name, plan.workers)
    console = quiet_console(plan)
    print(f"run {plan.name}: storage {plan.storage}/{plan.name}, data {plan.data_dir} "
          f"({plan.prepared.num_sequences} sequences, {plan.steps_per_epoch} steps per epoch), "
          f"workers {plan.opts['num_workers']} x {plan.opts['cpus_per_worker']:g} CPU(s)"
          + (f"; Ray's own messages: {console.log_path}" if console.installed else ""), flush=True)
    for note in plan.notes:
        print(note, flush=True)
    t0 = time.time()
    import ray.train

    try:
        result = trainer.fit()
    except ray.train.TrainingFailedError as e:
        more = f" (the workers' output: {console.log_path})" if console.installed else ""
        return fail(f"training failed: {worker_error_summary(e)}{more}", EXIT_FAILED)
    summarize(result, plan.run_dir, time.time() - t0)
    return 0


def quiet_console(plan: RunPlan, log_name: str = "ray-workers.log"):
    """Our lines on the console, Ray's routine output in the run folder (or a temp file for remote storage)."""
    import tempfile

    from .console import ConsoleFilter

    folder = plan.run_dir if plan.run_dir is not None else Path(tempfile.gettempdir()) / f"minilm-{plan.name}"
    console = ConsoleFilter(folder / log_name)
    console.install()
    return console


def uses_gpu(opts: dict) -> bool:
    import ray

    return opts["use_gpu"] == "true" or (opts["use_gpu"] == "auto" and ray.cluster_resources().get("GPU", 0) > 0)


def make_trainer(config: dict, opts: dict, storage: str, name: str, workers: tuple[int, int], callbacks=None):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .worker import train_func

    # Ray Train's controller takes one report per worker per poll, every 2 s by default, and a report made before
    # the previous one was taken blocks until the next poll: at GPU step times (10 steps between log steps well under
    # 2 s) that is most of the wall time (bench.overhead --mode report). Ray hands this variable from the process
    # that calls fit() to the controller; a value the user set wins.
    os.environ.setdefault(CONTROLLER_POLL_ENV, CONTROLLER_POLL_S)
    use_gpu = uses_gpu(opts)
    min_w, max_w = workers
    scaling = ScalingConfig(num_workers=min_w if min_w == max_w else (min_w, max_w), use_gpu=use_gpu,
                            resources_per_worker={"CPU": opts["cpus_per_worker"], **opts["resources_per_worker"]},
                            elastic_resize_monitor_interval_s=opts["elastic_check_seconds"])
    run_config = RunConfig(name=name, storage_path=storage,
                           failure_config=FailureConfig(max_failures=opts["max_failures"]),
                           checkpoint_config=CheckpointConfig(num_to_keep=opts["keep_checkpoints"]),
                           logging_config=LoggingConfig(log_level="WARNING"),  # our log line, not Ray's per report
                           callbacks=callbacks,
                           worker_runtime_env={"env_vars": worker_env(opts)})
    return TorchTrainer(train_func, train_loop_config=config, scaling_config=scaling, run_config=run_config,
                        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=round(
                            collective_timeout_s("cuda" if use_gpu else "cpu", opts.get("collective_timeout_s")))))


CONTROLLER_POLL_S = "0.1"
WORKER_ENV = ("MINILM_CACHE", "MINILM_GIT_COMMIT")  # the only MINILM_* settings a worker reads
# The CUDA, NCCL and torch debugging and tuning settings a user sets in the driver's shell, for every worker.
WORKER_ENV_GPU = ("TORCH_LOGS", "PYTORCH_CUDA_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING", "TORCHINDUCTOR_COMPILE_THREADS")
WORKER_ENV_GPU_PREFIXES = ("NCCL_", "TORCH_NCCL_")


def worker_env(opts: dict) -> dict[str, str]:
    threads = str(max(1, int(opts["cpus_per_worker"])))
    # Inductor compiles with up to 32 threads per process by default: a node's ranks compiling at once each take its
    # share of the CPUs, as their torch threads do.
    env = {"OMP_NUM_THREADS": threads, "TORCHINDUCTOR_COMPILE_THREADS": threads}
    env.update({k: v for k, v in os.environ.items() if k in WORKER_ENV_GPU or k.startswith(WORKER_ENV_GPU_PREFIXES)})
    # The cache dir and the trackers' own settings (WANDB_MODE=offline, MLFLOW_*) reach the workers even on an
    # already-running cluster, whose processes do not inherit this shell. Test hooks travel in the run's config,
    # never here. Secrets stay out: runtime env variables are shown in the dashboard (use netrc / a secret store).
    env.update({k: v for k, v in os.environ.items() if (k in WORKER_ENV or k.startswith(("WANDB_", "MLFLOW_")))
                and not k.endswith(("API_KEY", "TOKEN", "PASSWORD"))})
    if opts.get("trackers") and "MINILM_GIT_COMMIT" not in env:
        from minilm.trackers import code_version

        commit = code_version().get("git_commit")  # a job's working dir has no .git: name the commit here
        if commit:
            env["MINILM_GIT_COMMIT"] = commit
    return env


def worker_error_summary(e: BaseException) -> str:
    """The worker's own exception line, not Ray's 40-line wrapper; the class without its module
    ("CheckpointError: could not write ...", not "minilm.checkpoint.CheckpointError: ...")."""
    text = str(e)
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line and ("Error" in line.split(":")[0] or "Preempted" in line.split(":")[0]):
            name, colon, rest = line.partition(":")
            return name.rsplit(".", 1)[-1] + colon + rest if " " not in name else line
    return text.strip().splitlines()[-1] if text.strip() else type(e).__name__


def summarize(result, run_dir: Path | None, wall_s: float) -> None:
    metrics = result.metrics or {}
    ckpt = result.checkpoint
    print("\n=== run summary ===", flush=True)
    if not metrics:
        print("no optimizer step was run (the run had already reached its last step)")
    else:
        held_out = "".join(f"  {k} {metrics[k]:.4f}" for k in ("val_loss", "val_bpb") if k in metrics)
        print(f"steps {metrics['optimizer_step']}/{metrics['total_steps']}  samples {metrics['samples_seen']}  "
              f"tokens {metrics['tokens_seen']:,}  final loss {metrics['loss']:.4f}{held_out}  "
              f"wall {format_duration(wall_s)}", flush=True)
    if ckpt is not None:
        print(f"checkpoint  {ckpt.path}")
        weights = Path(ckpt.path) / "weights"
        if run_dir is not None and weights.is_dir():
            final = run_dir / "weights"
            shutil.rmtree(final, ignore_errors=True)
            shutil.copytree(weights, final)
            print(f"weights     {final}  (minilm.load_pretrained / python -m minilm.sample --weights {final})")
    if run_dir is not None and (run_dir / TIMELINE).is_file():
        print(f"world size  {run_dir / TIMELINE}\n" + format_timeline(WorldSizeTimeline(run_dir).rows()))
    if run_dir is not None and (run_dir / "metrics.jsonl").is_file():
        records = MetricsLog(run_dir / "metrics.jsonl").read()
        if records:
            first, last = records[0], records[-1]
            print(f"metrics     {run_dir / 'metrics.jsonl'}  loss {first['loss']:.4f} -> {last['loss']:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    sys.exit(main())
