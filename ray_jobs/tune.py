"""Ray Tune sweeps (lr, warmup, ...) over the distributed pretraining job.

    python -m ray_jobs.tune --data data/tok --num-samples 8 --max-concurrent-trials 2 --workers-per-trial 2 \\
        --search lr=loguniform:1e-4:3e-3 --search warmup_steps=choice:0,50,200 --scheduler asha --metric val_loss

Every pretrain flag applies to every trial; `--search NAME=SPEC` (or a `search:` mapping in --config YAML)
samples NAME per trial. Each trial is a full pretrain run (its own TorchTrainer, metrics forwarded by
TuneReportCallback) with its checkpoints under RUN_DIR/trials/. At the end: a table sorted by the metric
(also results.csv), best.yaml (for `ray_jobs.pretrain --config`) and loss_curves.png.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from minilm import checkpoint as C
from minilm import data as D
from minilm.cli import command, note
from minilm.config import ConfigError, ModelConfig, TrainConfig
from minilm.options import plan_steps
from minilm.run import DRY_RUN, RunPlan, write_config
from minilm.safety import check_name, join_uri, redact

from .cli import UsageError, load_yaml
from .pretrain import USER_ERRORS, check_options, plan_run
from .pretrain import build_parser as pretrain_parser

SEARCHABLE = {"lr": float, "warmup_steps": int, "min_lr_ratio": float, "schedule": str, "decay_fraction": float,
              "global_batch_size": int, "grad_clip": float, "router_aux_loss_coef": float, "weight_decay": float,
              "optimizer": str, "muon_lr": float, "muon_momentum": float, "embedding_lr_ratio": float}
KINDS = ("loguniform", "uniform", "choice", "grid")  # grid: every value, x --num-samples
SCHEDULERS = ("asha", "none")
TRIAL_CPUS = 0.1  # the Tune trial function itself only waits on its TorchTrainer
# The sweep's counts and their defaults (--grace-steps: --log-every's, once the plan has it).
COUNTS = (("num_samples", 4), ("max_concurrent_trials", 1), ("workers_per_trial", 1), ("grace_steps", 1))
SWEEP_KEYS = (*dict(COUNTS), "scheduler", "metric")  # the sweep's own settings, from flags or --config


@dataclass(frozen=True)
class SearchDim:
    name: str
    kind: str  # loguniform | uniform | choice | grid
    values: tuple  # (low, high) or the choices

    def to_tune(self):
        from ray import tune

        if self.kind in ("loguniform", "uniform"):
            return getattr(tune, self.kind)(*self.values)
        return (tune.grid_search if self.kind == "grid" else tune.choice)(list(self.values))


def parse_search(spec: str) -> SearchDim:
    """'lr=loguniform:1e-4:3e-3', 'warmup_steps=choice:0,50,200', 'grad_clip=uniform:0.5:2'."""
    if "=" not in spec:
        raise UsageError(f"--search {spec!r}: expected NAME=KIND:ARGS, e.g. lr=loguniform:1e-4:3e-3")
    name, _, rhs = spec.partition("=")
    name = name.strip().replace("-", "_")
    if name not in SEARCHABLE:
        raise UsageError(f"--search {spec!r}: unknown parameter {name!r}; searchable: {', '.join(SEARCHABLE)}")
    kind, _, args = rhs.partition(":")
    if kind not in KINDS:
        raise UsageError(f"--search {spec!r}: unknown kind {kind!r}; use {', '.join(KINDS)}")
    cast = SEARCHABLE[name]
    try:
        if kind in ("choice", "grid"):
            values = tuple(cast(float(v)) if cast is int and float(v).is_integer() else cast(v)
                           for v in args.split(",") if v.strip())
            if not values:
                raise ValueError("no values")
            if len(set(values)) != len(values):
                raise UsageError(f"--search {spec!r}: repeated value")
        else:
            low, high = (float(x) for x in args.split(":"))
            if cast is int:
                raise UsageError(f"--search {spec!r}: {name} is an integer; use choice:a,b,c")
            if not low < high:
                raise UsageError(f"--search {spec!r}: low {low:g} must be < high {high:g}")
            if kind == "loguniform" and low <= 0:
                raise UsageError(f"--search {spec!r}: loguniform needs low > 0")
            values = (low, high)
    except (ValueError, TypeError):
        raise UsageError(f"--search {spec!r}: cannot parse {rhs!r}; e.g. loguniform:1e-4:3e-3, uniform:0.5:2, "
                         f"choice:0,50,200") from None
    return SearchDim(name, kind, values)


def search_space(specs: list[str], yaml_search: dict | None) -> dict[str, SearchDim]:
    specs = [f"{name}={value}" for name, value in (yaml_search or {}).items()] + specs  # flags win over YAML
    dims = {dim.name: dim for dim in map(parse_search, specs)}
    if not dims:
        raise UsageError("nothing to search: give at least one --search NAME=SPEC (e.g. lr=loguniform:1e-4:3e-3)")
    return dims


def apply_params(model_cfg: ModelConfig, train_cfg: TrainConfig, params: dict) -> tuple[ModelConfig, TrainConfig]:
    m, t = ModelConfig.from_dict(model_cfg.to_dict()), TrainConfig.from_dict(train_cfg.to_dict())
    for name, value in params.items():
        setattr(m if name in ModelConfig.__dataclass_fields__ else t, name, value)
    return m, t


def check_space(dims: dict[str, SearchDim], plan: RunPlan) -> None:
    """Every value a dimension can take must give a valid run, checked one dimension at a time."""
    for dim in dims.values():
        for value in dim.values:  # the choices, or both ends of the range
            m, t = apply_params(plan.model_cfg, plan.train_cfg, {dim.name: value})
            try:
                check_options(m, t, plan.opts)
                plan_steps(t, plan.data.num_sequences, (plan.opts.workers[0],))
            except (ConfigError, UsageError, D.DataError) as e:
                raise UsageError(f"--search {dim.name}: value {value!r} gives an invalid run: {e}") from None


def trial(params: dict, plan: RunPlan, sweep_dir: str) -> None:
    """Tune function: build and fit this trial's TorchTrainer; Train metrics reach Tune by the callback."""
    from ray import tune
    from ray.tune.integration.ray_train import TuneReportCallback

    from .pretrain import RAY_SNAPSHOT, make_trainer, start_evaluator, worker_config

    m, t = apply_params(plan.model_cfg, plan.train_cfg, params)
    if t.optimizer == "auto":  # searched: the sweep's own choice, resolved once on the driver like every run's
        t.optimizer = plan.train_cfg.optimizer
    name = check_name(tune.get_context().get_trial_name(), "trial name")  # it names the trial's folder
    optimizer_why = plan.opts.optimizer_why if params.get("optimizer", "auto") == "auto" else ""
    opts = dataclasses.replace(plan.opts, name=name, optimizer_why=optimizer_why,
                               storage_path=join_uri(plan.opts.storage_path, plan.opts.name, "trials"),
                               run_dir=str(Path(sweep_dir) / "trials" / name) if plan.run_dir else None)
    folder = C.RunFolder(join_uri(opts.storage_path, name))
    folder.delete(RAY_SNAPSHOT)  # a restored trial: minilm's rules, not Ray's
    trial_plan = dataclasses.replace(plan, model_cfg=m, train_cfg=t, opts=opts)
    write_config(trial_plan, folder)  # for ray_jobs.pretrain --config
    evaluator = start_evaluator(trial_plan)  # --eval-tasks: the trial's checkpoints scored beside it
    try:
        make_trainer(worker_config(trial_plan), opts, callbacks=[TuneReportCallback()]).fit()
    finally:
        if evaluator is not None:
            evaluator.finish(opts.eval_wait_s)


def collect(results, dims: dict[str, SearchDim], metric: str) -> list[dict]:
    rows = []
    for r in results:
        params = r.config or {}
        m = r.metrics or {}
        step = m.get("optimizer_step", 0)
        status = "ERROR" if r.error else ("DONE" if step and step >= m.get("total_steps", math.inf) else "STOPPED")
        rows.append({"trial": Path(r.path).name if r.path else "?", **{d: params.get(d) for d in dims},
                     "steps": step, "loss": m.get("loss"), "val_loss": m.get("val_loss"), "val_bpb": m.get("val_bpb"),
                     metric: m.get(metric), "tokens_per_s": m.get("tokens_per_s"), "status": status,
                     "_records": reported_records(r.metrics_dataframe)})
    sign = -1 if metric_mode(metric) == "max" else 1  # the best first
    rows.sort(key=lambda r: (r[metric] is None or (isinstance(r[metric], float) and math.isnan(r[metric])),
                             sign * r[metric] if r[metric] is not None else math.inf))
    return rows


def write_results(rows: list[dict], dims: dict[str, SearchDim], plan: RunPlan, out: Path, metric: str) -> None:
    cols = ["trial", *dims, "steps", *dict.fromkeys(["loss", "val_loss", "val_bpb", metric]), "tokens_per_s", "status"]
    fmt = {float: lambda v: f"{v:.4g}", int: str}
    table = [[fmt.get(type(r[c]), str)(r[c]) if r[c] is not None else "-" for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in table)) for i, c in enumerate(cols)]
    print(f"\n=== sweep {plan.opts.name}: {len(rows)} trials, sorted by {metric} ===")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    for row in table:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(cols)
        writer.writerows([[r[c] for c in cols] for r in rows])
    best = next((r for r in rows if r["status"] != "ERROR"), None)
    if best is not None:
        m, t = apply_params(plan.model_cfg, plan.train_cfg, {d: best[d] for d in dims})
        best_cfg = {**m.to_dict(), **t.to_dict(), "data": redact(plan.opts.data_dir)}  # give --data's secret again
        (out / "best.yaml").write_text(f"# best trial {best['trial']} of sweep {plan.opts.name} by {metric}\n"
                                       + yaml.safe_dump(best_cfg, sort_keys=True))
        print(f"best: {best['trial']} -> {out / 'best.yaml'}  (python -m ray_jobs.pretrain --config {out / 'best.yaml'})")
    drawn = plot_trials(rows, dims, out / "loss_curves.png") is not None
    print(f"table: {out / 'results.csv'}" + (f"  plot: {out / 'loss_curves.png'}" if drawn else ""))


def reported_records(df) -> list[dict]:
    """A trial's reported metrics (Tune's dataframe) as records like metrics.jsonl's: numbers only, NaN dropped."""
    if df is None or "optimizer_step" not in df:
        return []
    records = []
    for row in df.to_dict("records"):
        values = {k: v.item() if hasattr(v, "item") else v for k, v in row.items()}  # numpy scalars -> int / float
        rec = {k: v for k, v in values.items()
               if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
        if "optimizer_step" in rec:
            rec["optimizer_step"] = int(rec["optimizer_step"])
            records.append(rec)
    return records


def plot_trials(rows: list[dict], dims: dict[str, SearchDim], path: Path):
    """ray_jobs.plot's figure of every trial, labelled with its searched values, written to `path`; returns it, or
    None (and a note) without matplotlib (an extra)."""
    try:
        from . import plot
    except ImportError:
        print(f"note: {path.name} not drawn: matplotlib is not installed (pip install 'minilm[plot]')")
        return None
    runs = []
    for r in rows:
        values = ", ".join(f"{d}={r[d]:g}" if isinstance(r[d], (int, float)) else f"{d}={r[d]}" for d in dims)
        runs.append(plot.RunCurves(f"{r['trial']} ({values})", plot.in_step_order(r["_records"])))
    return plot.save_figure(runs, path)


def build_parser() -> argparse.ArgumentParser:
    p = pretrain_parser("python -m ray_jobs.tune", __doc__, skip=("num_workers", "abandon_newer", "resume"),
                        run_name="sweep")
    g = p.add_argument_group("sweep")
    g.add_argument("--resume", choices=["auto", "never"], nargs="?", const="auto", default="never",
                   help="auto: continue the sweep in --run-dir (finished trials are not re-run), or start it; never: "
                        "refuse a --run-dir that holds a sweep")
    g.add_argument("--search", action="append", default=[], metavar="NAME=SPEC",
                   help=f"sample NAME per trial: loguniform:LOW:HIGH, uniform:LOW:HIGH, choice:A,B,C (random) or "
                        f"grid:A,B,C (every value, x --num-samples); NAME in {', '.join(SEARCHABLE)} (default: "
                        f"the config file's search: mapping)")
    g.add_argument("--num-samples", type=int, default=None, help="trials, or repeats of the grid (default 4)")
    g.add_argument("--max-concurrent-trials", type=int, default=None, help="trials run at once (default 1)")
    g.add_argument("--workers-per-trial", type=int, default=None, help="Ray Train workers per trial (default 1)")
    g.add_argument("--scheduler", choices=SCHEDULERS, default=None,
                   help="asha: stop the trials that fall behind at each rung; none: run every trial to its end "
                        "(default asha)")
    g.add_argument("--grace-steps", type=int, default=None, help="ASHA: optimizer steps before a trial can stop "
                                                                 "(default: --log-every)")
    g.add_argument("--metric", default=None,
                   help="what ranks the trials: loss, val_loss or val_bpb (minimised), or a score of --eval-tasks, "
                        "eval/<task>/<metric> (acc and acc_norm maximised, bpb minimised) (default: val_loss when "
                        "--val-samples > 0, else loss)")
    return p


@command(*USER_ERRORS, interrupted="interrupted; continue the sweep with --resume auto and the same --run-dir")
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--resume" in argv and argv[argv.index("--resume") + 1:][:1] not in (["auto"], ["never"]):
        note("--resume alone is now --resume auto")
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    file_values = load_yaml(args.config)
    dims = search_space(args.search, file_values.pop("search", None))
    sweep_opts = {k: file_values.pop(k, None) for k in SWEEP_KEYS}
    sweep_opts.update({k: getattr(args, k) for k in sweep_opts if getattr(args, k) is not None})
    counts = [default if sweep_opts[k] is None else sweep_opts[k] for k, default in COUNTS]
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):  # a YAML "4", or 2.5
        raise UsageError(f"--num-samples, --max-concurrent-trials, --workers-per-trial, --grace-steps: whole numbers, "
                         f"got {', '.join(map(repr, counts))}")
    for (key, _), n in zip(COUNTS, counts, strict=True):
        if n < 1:  # 0 is no default: it is refused like any other count below 1
            raise UsageError(f"--{key.replace('_', '-')} must be >= 1, got {n}")
    num_samples, concurrent, workers = counts[:3]
    scheduler = sweep_opts["scheduler"] or "asha"
    if scheduler not in SCHEDULERS:  # a YAML value argparse did not see
        raise UsageError(f"--scheduler must be one of {', '.join(SCHEDULERS)}, got {scheduler!r}")
    args.num_workers = str(workers)
    args.name = args.name or time.strftime("sweep-%Y%m%d-%H%M%S")
    resume_sweep, args.resume = args.resume, "auto"  # a restored trial continues its own latest checkpoint
    plan = plan_run(args, concurrent_runs=concurrent, reserved_cpus=concurrent * TRIAL_CPUS, file_values=file_values,
                    sweep=True)  # RUN/config.yaml: each trial's, in its folder
    plan.opts.tracker_group = plan.opts.name  # trials of one sweep: one W&B group / MLflow tag
    try:
        metric = check_metric(sweep_opts["metric"], plan)
        check_space(dims, plan)
        eval_cpus = plan.opts.eval_resources.get("CPU", 0) if plan.eval_tasks else 0  # one scoring per trial at a time
        check_capacity(concurrent, workers, plan.opts.cpus_per_worker, plan.opts.use_gpu, eval_cpus)
        grace = counts[3] if sweep_opts["grace_steps"] is not None else max(1, plan.train_cfg.log_every)
        return sweep(plan, dims, num_samples, concurrent, scheduler, grace, metric, resume_sweep)
    finally:
        plan.release()


def check_metric(metric: str | None, plan: RunPlan) -> str:
    """--metric: a training metric, or a score of --eval-tasks (checked against the task list)."""
    metric = metric or ("val_loss" if plan.train_cfg.val_samples > 0 else "loss")
    if metric in ("val_loss", "val_bpb") and plan.train_cfg.val_samples == 0:
        raise UsageError(f"--metric {metric} needs --val-samples N > 0")
    if metric.startswith("eval/"):
        if not plan.eval_tasks:
            raise UsageError(f"--metric {metric} is a score of checkpoints evaluated beside training: give --eval-tasks")
        from .evaluator import check_best_metric

        return check_best_metric(metric, plan.eval_tasks, flag="--metric")
    if metric not in ("loss", "val_loss", "val_bpb"):
        raise UsageError(f"--metric {metric}: choose loss, val_loss, val_bpb or eval/<task>/<metric> (--eval-tasks)")
    return metric


def metric_mode(metric: str) -> str:
    """Tune's mode: losses are minimised; a score of --eval-tasks as the best checkpoint is chosen."""
    return C.canonical(metric)[1] if metric.startswith("eval/") else "min"


def check_capacity(concurrent: int, workers: int, cpus_per_worker: float, use_gpu: str, eval_cpus: float) -> None:
    import ray

    cluster = ray.cluster_resources()
    total_cpu = cluster.get("CPU", 0)
    per_trial = workers * cpus_per_worker + TRIAL_CPUS + eval_cpus
    need = concurrent * per_trial
    if need > total_cpu:
        scoring = f" + --eval-resources CPU={eval_cpus:g}" if eval_cpus else ""
        raise UsageError(f"--max-concurrent-trials {concurrent} x (--workers-per-trial {workers} x "
                         f"--cpus-per-worker {cpus_per_worker:g} + {TRIAL_CPUS}{scoring}) = {need:g} CPUs, but the "
                         f"cluster has {total_cpu:g}; at most {int(total_cpu // per_trial)} concurrent trial(s) fit")
    if use_gpu == "true" and concurrent * workers > cluster.get("GPU", 0):
        raise UsageError(f"{concurrent} concurrent trials x {workers} workers need {concurrent * workers} GPUs; "
                         f"the cluster has {cluster.get('GPU', 0):g}")


def sweep(plan: RunPlan, dims, num_samples, concurrent, scheduler, grace, metric, resume: str) -> int:
    # val_loss comes only every --eval-every steps; the reports between carry loss but not val_loss
    os.environ.setdefault("TUNE_DISABLE_STRICT_METRIC_CHECKING", "1")
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    sweep_path = join_uri(plan.opts.storage_path, plan.opts.name)  # before a URI's ?query
    restore = tune.Tuner.can_restore(sweep_path)
    if restore and resume != "auto":
        raise UsageError(f"sweep {plan.opts.name} already exists under {redact(plan.opts.storage_path)}: add "
                         f"--resume auto to continue it, or choose another --run-dir")
    if plan.opts.dry_run:
        print(DRY_RUN)
        return 0
    shipped = dataclasses.replace(plan, lease=None)  # the lease stays with this driver
    trainable = tune.with_resources(tune.with_parameters(trial, plan=shipped, sweep_dir=sweep_path),
                                    {"CPU": TRIAL_CPUS})
    if restore:
        print(f"resuming sweep {plan.opts.name} from {redact(sweep_path)}", flush=True)
        tuner = tune.Tuner.restore(sweep_path, trainable=trainable, resume_errored=True)
    else:
        sched = None
        if scheduler == "asha":
            # max_t one past the last step: a trial stopped at max_t would leave its workers' placement group behind.
            sched = ASHAScheduler(time_attr="optimizer_step", max_t=max(plan.steps.total_steps, grace) + 1,
                                  grace_period=grace, reduction_factor=2)
        tuner = tune.Tuner(
            trainable, param_space={d.name: d.to_tune() for d in dims.values()},
            tune_config=tune.TuneConfig(metric=metric, mode=metric_mode(metric), num_samples=num_samples,
                                        scheduler=sched, max_concurrent_trials=concurrent),
            run_config=tune.RunConfig(name=plan.opts.name, storage_path=plan.opts.storage_path),
        )
    results = tuner.fit()
    rows = collect(results, dims, metric)
    out = Path(sweep_path) if plan.run_dir else Path("runs") / plan.opts.name
    write_results(rows, dims, plan, out, metric)
    return 0 if any(r["status"] != "ERROR" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
