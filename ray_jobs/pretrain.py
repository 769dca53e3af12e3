"""Pretrain a MiniMind-class model with Ray Train.

    python -m ray_jobs.pretrain                                   # small model, built-in corpus, local Ray
    python -m ray_jobs.pretrain --data data/tok --num-workers 2-8 --run-dir s3://bucket/runs/run1
    ray job submit --working-dir . -- python -m ray_jobs.pretrain --run-dir /shared/runs/run1 --resume auto

Every ModelConfig / TrainConfig field and run option is a flag, or a key of `--config FILE.yaml` (flags win);
`--resume auto` continues the run folder's latest complete checkpoint at any world size that keeps the global batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from pathlib import Path

from minilm import checkpoint as C
from minilm import data as D
from minilm import run as run_plan
from minilm import testing
from minilm.cli import ArgumentParser, command, fail
from minilm.config import ConfigError, ModelConfig, TrainConfig, check_fits
from minilm.distributed import collective_timeout_s
from minilm.errors import EXIT_FAILED, UsageError
from minilm.options import (
    RunSpec,
    add_run_flags,
    build_configs,
    check_configs,
    check_world_sizes,
    load_yaml,
)
from minilm.progress import MetricsLog, format_duration
from minilm.rows import rows_note
from minilm.run import RunPlan
from minilm.safety import check_name, join_uri, redact
from minilm.step import cuda_alloc_env
from minilm.timeline import TIMELINE, WorldSizeTimeline, format_timeline
from minilm.trackers import TrackerError

from .cli import RayOptions, apply_run_dir, available_cores, ensure_ray
from .elastic import SHARED_STORAGE_HINT, nodes_missing_path
from .ray_compat import CONTROLLER_POLL_ENV, JOB_DRIVER_ENV


def build_parser(prog: str = "python -m ray_jobs.pretrain", doc: str = __doc__, skip: tuple[str, ...] = (),
                 run_name: str = "minilm") -> ArgumentParser:
    """pretrain's flags; ray_jobs.tune's too, but those of `skip` (RayOptions fields)."""
    p = ArgumentParser(prog=prog, description=doc.split("\n")[0])
    p.add_argument("--config", help="YAML file of option: value (any flag below, underscores or dashes; default: "
                                    "none)")
    p.add_argument("--run-dir", dest="run_folder", metavar="DIR|URI",  # RayOptions.run_dir is what plan_run makes
                   help=f"the run folder: checkpoints, metrics.jsonl, world_size.csv; a local path or a pyarrow URI "
                        f"(s3://, gs://) (default: ./runs/{run_name}-<time>)")
    add_run_flags(p, RayOptions, skip)
    p.rename("--run-dir STORAGE/NAME", "--storage-path", "--name")
    p.after.append(apply_run_dir)
    return p


USER_ERRORS = (UsageError, ConfigError, D.DataError, C.CheckpointError, TrackerError)  # one line, exit 2


@command(*USER_ERRORS, interrupted="interrupted; continue with --resume auto and the same --run-dir")
def main(argv: list[str] | None = None) -> int:
    os.umask(0o027)  # run folders and checkpoints: readable by their owner and group only
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # one place for every way in (python -m, the minilm command)
    return run(build_parser().parse_args(argv))


def worker_config(plan: RunPlan) -> dict:
    """The train_loop_config every worker of the plan's run (or Tune trial) gets, one object."""
    run_opts = dataclasses.replace(plan.opts)
    run_opts.run_id = f"{run_opts.name}-{int(time.time())}"
    run_opts.storage_dir = printable_run_dir(run_opts)
    shown, hidden = without_secrets(RunSpec(plan.model_cfg, plan.train_cfg, run_opts, plan.steps).to_dict())
    if hidden:  # the dashboard shows train_loop_config: the credentials travel in the object store instead
        import ray

        shown["secrets"] = ray.put(hidden)
    return shown


def printable_run_dir(opts: RayOptions) -> str:
    """STORAGE/NAME as messages name it: without the URI's ?query (the storage's options) and its credentials."""
    return redact(join_uri(opts.storage_path.split("?", 1)[0], opts.name))


def without_secrets(config: dict) -> tuple[dict, dict]:
    """A RunSpec dict with every credential redacted, and the values it hid (`worker.with_secrets` restores them)."""
    run = config["run"]
    hidden = {k: v for k, v in run.items() if isinstance(v, str) and redact(v) != v}
    return {**config, "run": {**run, **{k: redact(v) for k, v in hidden.items()}}}, hidden


def check_options(model_cfg: ModelConfig, train_cfg: TrainConfig, opts: RayOptions) -> None:
    """Every check that needs no data and no Ray."""
    check_configs(model_cfg, train_cfg, opts)
    check_fits(model_cfg, train_cfg)  # check_configs leaves it to check_run when the manifest sets seq_len
    check_world_sizes(train_cfg, RayLaunch.world_sizes(opts), where=f"--num-workers {opts.num_workers}: ")


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's list of the checkpoints it registered


class RayLaunch(run_plan.Launch):
    """pretrain's side of the run plan; for --cpus-per-worker auto, `concurrent_runs` share the cluster (Tune
    trials) and their other actors hold `reserved_cpus`."""

    def __init__(self, demo: bool, concurrent_runs: int = 1, reserved_cpus: float = 0.0, sweep: bool = False):
        self.demo, self.concurrent_runs, self.reserved_cpus = demo, concurrent_runs, reserved_cpus
        self.writes_config = not sweep
        self.started_ray: bool | None = None
        self.eval_tasks: list = []

    def ray(self, opts: RayOptions) -> bool:
        """Ray started or joined, once; True when this command started it (its machine is all the run has)."""
        if self.started_ray is None:
            self.started_ray = ensure_ray(opts.num_cpus)
        return self.started_ray

    def check(self, model_cfg: ModelConfig, train_cfg: TrainConfig, opts: RayOptions) -> None:
        opts.name = check_name(opts.name or time.strftime("minilm-%Y%m%d-%H%M%S"), "--name")  # STORAGE/NAME
        check_world_sizes(train_cfg, self.world_sizes(opts), where=f"--num-workers {opts.num_workers}: ")
        if "://" not in opts.storage_path:
            if JOB_DRIVER_ENV in os.environ and not Path(opts.storage_path).expanduser().is_absolute():
                print(f"warning: the run folder {join_uri(opts.storage_path, opts.name)} (--run-dir) is relative: in a "
                      f"Ray job it lands in the job's temporary working directory ({Path.cwd()}), which Ray may "
                      f"delete; give --run-dir an absolute path on shared storage or a URI (s3://, gs://)",
                      file=sys.stderr, flush=True)
            opts.storage_path = str(Path(opts.storage_path).expanduser().resolve())
            opts.run_dir = str(Path(opts.storage_path) / opts.name)
        self.eval_tasks = check_eval_options(opts)

    def open_data(self, model_cfg: ModelConfig, train_cfg: TrainConfig, opts: RayOptions, notes: list):
        if self.demo:
            from .demo_data import demo_data_dir

            self.ray(opts)  # the demo's prepare joins it rather than starting (and ending) a Ray of its own
            opts.data_dir = str(demo_data_dir(train_cfg.seq_len, model_cfg.vocab_size))
        else:
            opts.data_dir = opts.data if D.is_remote(opts.data) else str(Path(opts.data).expanduser().resolve())
        prepared = D.open_prepared(opts.data_dir)  # a missing, incomplete or damaged --data: refused before Ray
        notes += [D.fit_configs(prepared, model_cfg, train_cfg, opts.from_manifest),
                  rows_note(prepared.manifest, prepared.location)]
        return prepared

    @staticmethod
    def world_sizes(opts: RayOptions) -> range:
        return range(opts.workers[0], opts.workers[1] + 1)

    def check_cluster(self, plan: RunPlan) -> None:
        opts = plan.opts
        started_here = self.ray(opts)
        if opts.cpus_per_worker is None:
            # Each run's scoring and each further run's Ray Data (the first one's CPU is kept anyway) come first:
            # workers that take them leave a validation stream or a scoring waiting for good.
            runs = self.concurrent_runs
            scoring = runs * opts.eval_resources.get("CPU", 0) if self.eval_tasks else 0
            opts.cpus_per_worker = auto_cpus_per_worker(opts.workers[1] * runs, started_here, opts,
                                                        self.reserved_cpus + scoring + runs - 1)
        missing = nodes_missing_path(Path(opts.storage_path)) if opts.run_dir else []
        if missing:
            raise UsageError(f"--storage-path {opts.storage_path} is not visible from {len(missing)} node(s) of this "
                             f"cluster ({', '.join(missing)}): {SHARED_STORAGE_HINT}")
        if plan.train_cfg.dtype == "fp16" and not uses_gpu(opts):
            raise UsageError("--dtype fp16 needs GPU workers (CPU autocast supports bf16 or fp32); this run has none: "
                             "use --dtype bf16, fp32 or auto")
        if self.eval_tasks and not nodes_with(opts.eval_resources):  # a scoring no node can run would wait forever
            spec = ",".join(f"{k}={v:g}" for k, v in opts.eval_resources.items())
            raise UsageError(f"--eval-resources {spec}: no node of this Ray cluster has that much (ray status shows "
                             f"what each node offers)")
        plan.eval_tasks = self.eval_tasks

    def folder(self, opts: RayOptions) -> C.RunFolder:
        return C.RunFolder(join_uri(opts.storage_path, opts.name), display=printable_run_dir(opts))

    def resolve(self, plan: RunPlan) -> None:  # one precision and optimizer for every rank and restart
        cfg = plan.train_cfg
        if "auto" in (cfg.dtype, cfg.optimizer):
            cfg.dtype, cfg.optimizer, plan.opts.optimizer_why = probe_auto(plan)

    def act(self, plan: RunPlan) -> None:
        plan.folder.delete(RAY_SNAPSHOT)  # Ray would refuse an index naming a checkpoint minilm pruned or moved aside
        hooks = testing.from_env(warn=lambda m: print(m, file=sys.stderr, flush=True))
        if hooks:
            plan.opts.test_hooks = hooks.to_dict()
            if hooks.record_sample_ids:
                Path(hooks.record_sample_ids).mkdir(parents=True, exist_ok=True)


def plan_run(args: argparse.Namespace, concurrent_runs: int = 1, reserved_cpus: float = 0.0,
             file_values: dict | None = None, sweep: bool = False) -> RunPlan:
    """Flags + YAML (`file_values`, else --config's) -> a checked RunPlan holding its run folder's lease."""
    started_at = time.time()
    file_values = load_yaml(args.config) if file_values is None else file_values
    demo = not (args.data or file_values.get("data"))
    configs = build_configs(args, file_values, RayOptions, demo=demo)
    configs.run.started_at = started_at
    return run_plan.plan_run(configs, RayLaunch(demo, concurrent_runs, reserved_cpus, sweep), lambda m: print(m, flush=True))


def check_eval_options(opts: RayOptions) -> list:
    """--eval-tasks read and checked (every item) before any work, and what rank 0 needs to know of them."""
    if not opts.eval_tasks:
        return []
    from minilm.tasks import TaskError, load_tasks

    from .evaluator import check_best_metric

    if opts.run_dir is None:
        raise UsageError(f"--eval-tasks needs a local or shared --storage-path, where the evaluation tasks read the "
                         f"checkpoints (not {redact(opts.storage_path)}); score a remote run's checkpoints with "
                         f"python -m ray_jobs.evaluate after copying them")
    try:
        tasks = load_tasks(opts.eval_tasks)  # every item read and checked before any training starts
    except TaskError as e:
        raise UsageError(f"--eval-tasks: {e}") from None
    opts.eval_best = check_best_metric(opts.eval_best, tasks)
    opts.eval_task_names, opts.eval_wait_s = [t.name for t in tasks], opts.eval_wait_minutes * 60
    return tasks


def auto_cpus_per_worker(workers: int, local: bool, opts: RayOptions, reserved_cpus: float = 0.0) -> float:
    """--cpus-per-worker auto: a local Ray's cores (its logical CPUs overstate them) shared among the workers; on a
    cluster, the smallest fitting node less one CPU for Ray Data (its feed starves otherwise) and `reserved_cpus`."""
    if local:
        return float(max(1, available_cores() // max(1, workers)))
    nodes = nodes_with({"CPU": 1, **opts.resources_per_worker})  # its custom resources are never CPU or GPU
    if uses_gpu(opts):
        per_gpu = [(r["CPU"] - 1) // r["GPU"] for r in nodes if r.get("GPU", 0) >= 1]
        return float(max(1, int(min(per_gpu)))) if per_gpu else 1.0
    if not nodes:
        return 1.0
    per_node = -(-workers // len(nodes))
    return float(max(1, int(min(r["CPU"] for r in nodes) - 1 - math.ceil(reserved_cpus)) // per_node))


def probe_auto(plan: RunPlan) -> tuple[str, str, str]:
    """Resolve `--dtype auto` and `--optimizer auto` in one Ray task placed like a training worker (GPU, CPUs, custom
    resources), at the most workers the run may have: (dtype, optimizer, why auto chose it)."""
    import ray

    from minilm.step import resolve_auto

    opts, model_cfg, train_cfg = plan.opts, plan.model_cfg, dataclasses.replace(plan.train_cfg)
    use_gpu = uses_gpu(opts)

    @ray.remote(num_cpus=0.01 if use_gpu else max(0.01, opts.cpus_per_worker), num_gpus=1 if use_gpu else 0,
                resources=opts.resources_per_worker or None)
    def probe() -> tuple[str, str, str]:
        why = resolve_auto(model_cfg, train_cfg, "cuda" if use_gpu else "cpu", opts.workers[1])
        return train_cfg.dtype, train_cfg.optimizer, why

    try:
        return ray.get(probe.remote(), timeout=180)
    except ray.exceptions.GetTimeoutError:
        dtype = train_cfg.dtype if train_cfg.dtype != "auto" else "bf16" if use_gpu else "fp32"
        optimizer = train_cfg.optimizer if train_cfg.optimizer != "auto" else "muon"
        print(f"warning: no worker-like slot free within 3 minutes to probe --dtype / --optimizer auto: using "
              f"{dtype}, {optimizer} (set --dtype and --optimizer to choose)", file=sys.stderr, flush=True)
        return dtype, optimizer, ""


def nodes_with(resources: dict[str, float]) -> list[dict]:
    """The resources of each alive node of the cluster that offers at least `resources`."""
    import ray

    return [n["Resources"] for n in ray.nodes()
            if n.get("Alive") and all(n["Resources"].get(k, 0) >= v for k, v in resources.items())]


def run(args: argparse.Namespace) -> int:
    plan = plan_run(args)
    try:
        if plan.opts.dry_run:
            print(run_plan.DRY_RUN)
            return 0
        return start(plan)
    finally:
        plan.release()


def start(plan: RunPlan) -> int:
    opts = plan.opts
    trainer = make_trainer(worker_config(plan), opts)
    console = quiet_console(plan)
    print(f"run {opts.name}: storage {redact(join_uri(opts.storage_path, opts.name))}, "
          f"data {redact(opts.data_dir)} "
          f"({plan.data.num_sequences} sequences, {plan.steps.steps_per_epoch} steps per epoch), "
          f"workers {opts.num_workers} x {opts.cpus_per_worker:g} CPU(s)"
          + (f"; Ray's own messages: {console.log_path}" if console.installed else ""), flush=True)
    for note in plan.notes:
        print(note, flush=True)
    t0 = time.time()
    import ray.train

    evaluator = start_evaluator(plan)
    finished = False
    try:
        result = trainer.fit()
        finished = True
    except ray.train.TrainingFailedError as e:
        more = f" (the workers' output: {console.log_path})" if console.installed else ""
        return fail(f"training failed: {worker_error_summary(e)}{more}", EXIT_FAILED)
    finally:
        if evaluator is not None:  # after a failure, what is not scored yet is left to a resubmit
            evaluator.finish(opts.eval_wait_s if finished else 0.0)
    summarize(result, plan.run_dir, time.time() - t0)
    return 0


def start_evaluator(plan: RunPlan):
    """--eval-tasks: the checkpoints scored beside training (ray_jobs.evaluator), from before the first one."""
    if not plan.eval_tasks:
        return None
    from .evaluator import Evaluator

    opts = plan.opts
    tokenizer = None if D.is_remote(opts.data_dir) else plan.data.tokenizer_path  # remote: the checkpoints'
    print(f"eval  {len(plan.eval_tasks)} task(s) from {opts.eval_tasks} on each new checkpoint, on "
          f"{','.join(f'{k}={v:g}' for k, v in opts.eval_resources.items())} per checkpoint; scores to "
          f"{plan.run_dir / 'eval.jsonl'}" + (f", best by {opts.eval_best}" if opts.eval_best else ""), flush=True)
    return Evaluator(plan.run_dir, opts.eval_tasks, plan.eval_tasks, opts.eval_resources, opts.name, opts.eval_best,
                     tokenizer=str(tokenizer) if tokenizer is not None and tokenizer.is_file() else None).start()


def quiet_console(plan: RunPlan):
    """Our lines on the console, Ray's routine output in the run folder (remote storage: a new private folder)."""
    import tempfile

    from .console import ConsoleFilter

    folder = plan.run_dir if plan.run_dir is not None else Path(tempfile.mkdtemp(prefix=f"minilm-{plan.opts.name}-"))
    console = ConsoleFilter(folder / "ray-workers.log")
    console.install()
    return console


def uses_gpu(opts: RayOptions) -> bool:
    import ray

    return opts.use_gpu == "true" or (opts.use_gpu == "auto" and ray.cluster_resources().get("GPU", 0) > 0)


def make_trainer(config: dict, opts: RayOptions, callbacks=None):
    from ray.train import CheckpointConfig, FailureConfig, LoggingConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from .worker import train_func

    # Ray Train's controller takes one report per worker per poll (2 s by default), and a report made sooner
    # blocks until then; Ray hands this variable to the controller, and a value the user set wins.
    os.environ.setdefault(CONTROLLER_POLL_ENV, CONTROLLER_POLL_S)
    use_gpu = uses_gpu(opts)
    min_w, max_w = opts.workers
    scaling = ScalingConfig(num_workers=min_w if min_w == max_w else (min_w, max_w), use_gpu=use_gpu,
                            resources_per_worker={"CPU": opts.cpus_per_worker, **opts.resources_per_worker},
                            elastic_resize_monitor_interval_s=opts.elastic_check_seconds)
    run_config = RunConfig(name=opts.name, storage_path=opts.storage_path,
                           failure_config=FailureConfig(max_failures=opts.failures),
                           checkpoint_config=CheckpointConfig(num_to_keep=None),  # minilm prunes (C.RunFolder.prune)
                           logging_config=LoggingConfig(log_level="WARNING"),  # our log line, not Ray's per report
                           callbacks=callbacks,
                           worker_runtime_env={"env_vars": worker_env(opts, use_gpu)})
    return TorchTrainer(train_func, train_loop_config=config, scaling_config=scaling, run_config=run_config,
                        torch_config=TorchConfig(backend="nccl" if use_gpu else "gloo", timeout_s=round(
                            collective_timeout_s("cuda" if use_gpu else "cpu", opts.collective_timeout_s))))


CONTROLLER_POLL_S = "0.1"
WORKER_ENV = ("MINILM_CACHE", "MINILM_GIT_COMMIT")  # the only MINILM_* settings a worker reads
# The CUDA, NCCL and torch debugging and tuning settings a user sets in the driver's shell, for every worker.
WORKER_ENV_GPU = ("TORCH_LOGS", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "CUDA_LAUNCH_BLOCKING",
                  "TORCHINDUCTOR_COMPILE_THREADS")
WORKER_ENV_GPU_PREFIXES = ("NCCL_", "TORCH_NCCL_")


def worker_env(opts: RayOptions, use_gpu: bool = False) -> dict[str, str]:
    """What a worker on a running cluster (which does not inherit this shell) must see; never a secret (the
    dashboard shows runtime env variables). On GPUs, the CUDA allocator's setting (minilm.step.cuda_alloc_env)."""
    threads = str(max(1, int(opts.cpus_per_worker)))
    # Inductor compiles with up to 32 threads per process by default: each rank gets its share of the CPUs.
    env = {"OMP_NUM_THREADS": threads, "TORCHINDUCTOR_COMPILE_THREADS": threads}
    env.update({k: v for k, v in os.environ.items() if k in WORKER_ENV_GPU or k.startswith(WORKER_ENV_GPU_PREFIXES)})
    env.update(cuda_alloc_env() if use_gpu else {})
    env.update({k: v for k, v in os.environ.items() if (k in WORKER_ENV or k.startswith(("WANDB_", "MLFLOW_")))
                and not k.endswith(("API_KEY", "TOKEN", "PASSWORD"))})
    if opts.trackers and "MINILM_GIT_COMMIT" not in env:
        from minilm.trackers import code_version

        commit = code_version().get("git_commit")  # a job's working dir has no .git: name the commit here
        if commit:
            env["MINILM_GIT_COMMIT"] = commit
    return env


def worker_error_summary(e: BaseException) -> str:
    """The worker's own exception line, not Ray's 40-line wrapper, its class without the module."""
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
            try:  # a copy of the last export, replacing only an earlier one
                C.write_export(final, {f.name: lambda out, f=f: C.write_bytes(out, f.read_bytes())
                                       for f in weights.iterdir() if f.name != C.MARKER}, "weights")
                print(f"weights     {final}  (minilm.load_pretrained / python -m minilm.sample --checkpoint {final})")
            except C.CheckpointError as e:
                print(f"warning: weights not copied to {final}: {e}")
    if run_dir is not None and (run_dir / TIMELINE).is_file():
        print(f"world size  {run_dir / TIMELINE}\n" + format_timeline(WorldSizeTimeline(run_dir).rows()))
    if run_dir is not None and (run_dir / "metrics.jsonl").is_file():
        records = [r for r in MetricsLog(run_dir / "metrics.jsonl").read() if "loss" in r]  # not eval records
        if records:
            first, last = records[0], records[-1]
            print(f"metrics     {run_dir / 'metrics.jsonl'}  loss {first['loss']:.4f} -> {last['loss']:.4f}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
