"""The options a run adds to the two configs, declared once: a field's metadata makes its flag in
`minilm.train` (TRAIN) and/or `ray_jobs.pretrain` (PRETRAIN), its YAML key and its check, and the same
dataclass is what the Trainer and every Ray worker get. `plan_steps` works out a run's steps, once."""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field

from . import data as D
from .cli import DEMO_PRESET, UsageError, flag
from .config import ConfigError, ModelConfig, TrainConfig, check_fits, valid_world_sizes

TRAIN, PRETRAIN = "minilm.train", "ray_jobs.pretrain"
BOTH = (TRAIN, PRETRAIN)


def parse_num_workers(spec) -> tuple[int, int]:  # 'N' or 'MIN-MAX'
    try:
        lo, _, hi = str(spec).partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise UsageError(f"--num-workers {spec!r}: expected N or MIN-MAX, e.g. 2 or 2-8") from None
    if lo < 1 or hi < lo:
        raise UsageError(f"--num-workers {spec!r}: need 1 <= MIN <= MAX")
    return lo, hi


def parse_cpus(value) -> float | None:  # --cpus-per-worker: auto (None) or a number > 0
    if value is None or str(value) == "auto":
        return None
    try:
        cpus = float(value)
    except ValueError:
        cpus = -1.0
    if not cpus > 0:
        raise UsageError(f"--cpus-per-worker must be auto or a number > 0, got {value!r}")
    return cpus


def parse_resources(spec) -> dict[str, float]:  # 'slot=1,disk=2' or a YAML mapping -> {'slot': 1.0, 'disk': 2.0}
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


def option(default=None, help: str | dict[str, str] = "", *, cli=BOTH, group="run", minimum=None, convert=None,
           **argparse_kwargs):
    """A RunOptions field with a flag; `minimum` 0 means > 0, `convert` turns a flag's or YAML's value into the field's."""
    meta = {"help": help, "cli": cli, "group": group, "minimum": minimum, "convert": convert, "argparse": argparse_kwargs}
    if isinstance(default, (dict, list)):
        return field(default_factory=type(default), metadata=meta)
    return field(default=default, metadata=meta)


TRACKER_HELP = "experiment tracker(s) rank 0 logs every reported metric to, repeated or comma-separated (docs/tracking.md)"
TIMEOUT_HELP = ("seconds a rank waits in one collective for the others before the run fails (a rank hung or gone); "
                "default 600 on GPUs (NCCL), 1800 on CPUs (gloo)")


@dataclass
class RunOptions:
    """What a run adds to the two configs: the fields with a flag, in --help order, then what the entry point fills in."""

    data: str | None = option(help={TRAIN: "a folder written by ray_jobs.prepare",
                                    PRETRAIN: "a folder written by ray_jobs.prepare, or a remote URI; default: the "
                                              "built-in demo corpus, prepared once into ~/.cache/minilm"},
                              group="data")
    tokens: str | None = option(help="a .npy file of 1-D token ids", cli=(TRAIN,), group="data")
    random_tokens: int | None = option(help="train on this many uniformly random token ids", cli=(TRAIN,),
                                       group="data")
    num_workers: str = option("2", "N, or MIN-MAX for an elastic run", cli=(PRETRAIN,))
    use_gpu: str = option("auto", "auto: GPUs if the cluster has any", cli=(PRETRAIN,),
                          choices=["auto", "true", "false"], convert=lambda v: str(v).lower())  # YAML's true too
    cpus_per_worker: float | None = option(
        help="CPUs (and torch threads) per worker, or auto (default): on a local Ray started by this command, the "
             "machine's cores divided among the workers; on a cluster, a node's CPUs divided among the workers it "
             "would host (GPU runs: its CPUs per GPU)", cli=(PRETRAIN,), convert=parse_cpus)
    resources_per_worker: dict[str, float] = option(
        {}, "custom Ray resources each worker also needs, e.g. spot_slot=1 (one worker per node that offers one)",
        cli=(PRETRAIN,), convert=parse_resources, metavar="NAME=N[,NAME=N]")
    storage_path: str = option("./runs", "local path or pyarrow URI (s3://, gs://)", cli=(PRETRAIN,))
    run_dir: str | None = option(help="checkpoints, metrics.jsonl and world_size.csv go here (default: none kept)",
                                 cli=(TRAIN,))
    name: str | None = option(help={TRAIN: "run name (default: the run folder's name)",
                                    PRETRAIN: "run name; resume finds checkpoints by it (default: minilm-<time>)"})
    resume: str = option("auto", "auto: continue the run's newest complete checkpoint; never; or a checkpoint PATH")
    max_failures: int = option(0, "worker-group restarts Ray Train may do", cli=(PRETRAIN,), minimum=0)
    keep_checkpoints: int = option(3, "the newest N complete checkpoints are kept", minimum=1)
    exit_after_steps: int | None = option(help="checkpoint and exit cleanly after this optimizer step", minimum=1)
    exit_after_minutes: float | None = option(help="checkpoint and exit cleanly after this many minutes", minimum=0)
    val_samples: int = option(0, "held-out sequences for val_loss and val_bpb; 0: no validation", minimum=0)
    eval_every: int | None = option(help="optimizer steps between val_loss evaluations (default: --checkpoint-every)",
                                    minimum=1)
    elastic_check_seconds: float = option(60.0, "how often Ray checks to resize an elastic run", cli=(PRETRAIN,),
                                          minimum=0)
    collective_timeout_s: float | None = option(help={TRAIN: "under torchrun: " + TIMEOUT_HELP,
                                                      PRETRAIN: TIMEOUT_HELP + "; with --max-failures the group "
                                                                "restarts from the last checkpoint"},
                                                minimum=0, aliases={PRETRAIN: ["--backend-timeout-s"]})
    num_cpus: int | None = option(help="logical CPUs of a local Ray (default max(8, 2 x cores))", cli=(PRETRAIN,),
                                  minimum=1)
    tracker: list[str] | None = option(help={TRAIN: TRACKER_HELP + "; needs --run-dir", PRETRAIN: TRACKER_HELP
                                             + "; the tracker run continues across resumes"},
                                       action="append", metavar="none|tensorboard|mlflow|wandb")
    mlflow_uri: str | None = option(help="MLflow tracking URI (default: sqlite:///RUN_DIR/mlflow.db)", cli=(PRETRAIN,))
    wandb_project: str | None = option(help="W&B project (default minilm); WANDB_MODE=offline works", cli=(PRETRAIN,))
    allow_config_change: bool = option(False, "resume even though the schedule or optimizer settings differ from the "
                                       "checkpoint's (lr, warmup, steps, betas, weight decay, ...): each change is "
                                       "logged and used", cli=(PRETRAIN,), action="store_true")
    run_id: str = ""
    data_dir: str | None = None  # the data every worker opens: a local folder, or a remote URI it copies once
    storage_dir: str | None = None  # STORAGE/NAME without the URI's query (named in upload errors)
    resume_path: str | None = None  # what a worker continues when Ray has no checkpoint of the run registered
    trackers: list[str] = field(default_factory=list)  # --tracker, checked
    tracker_options: dict | None = None
    tracker_group: str | None = None  # one W&B group / MLflow tag for the trials of a sweep
    test_hooks: dict | None = None  # minilm.testing.FaultHooks, only ever set by a test

    @property
    def workers(self) -> tuple[int, int]:
        return parse_num_workers(self.num_workers)

    @classmethod
    def from_dict(cls, d: dict) -> RunOptions:
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def validate(self) -> RunOptions:  # each field's type and minimum
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            low, value = f.metadata.get("minimum"), getattr(self, f.name)
            if low is None or value is None:
                continue
            if int in typing.get_args(hints[f.name]) or hints[f.name] is int:
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    raise UsageError(f"{flag(f.name)} must be an integer >= {low}, got {value!r}")
            elif not (isinstance(value, (int, float)) and math.isfinite(value) and
                      (value > 0 if low == 0 else value >= low)):
                raise UsageError(f"{flag(f.name)} must be {'> 0' if low == 0 else f'>= {low}'}, got {value!r}")
        return self


def cli_fields(cli: str) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(RunOptions) if cli in f.metadata.get("cli", ())]


def add_run_flags(parser: argparse.ArgumentParser, cli: str) -> None:
    """One flag per field `cli` has, defaulting to None so that `build_configs` tells a given value from a default."""
    hints = typing.get_type_hints(RunOptions)
    groups: dict[str, argparse._ActionsContainer] = {}
    for f in cli_fields(cli):
        meta = f.metadata
        if meta["group"] not in groups:
            group = parser.add_argument_group(meta["group"])
            groups[meta["group"]] = group.add_mutually_exclusive_group() if meta["group"] == "data" else group
        text = meta["help"][cli] if isinstance(meta["help"], dict) else meta["help"]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if default is not None and default is not False and default not in ({}, []):
            text += f" (default {default})"
        kwargs = {"dest": f.name, "default": None, "help": text, **meta["argparse"]}
        aliases = kwargs.pop("aliases", {}).get(cli, [])
        if "action" not in kwargs:
            base = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
            kwargs["type"] = str if meta["convert"] else base[0]
        groups[meta["group"]].add_argument(flag(f.name), *aliases, **kwargs)


@dataclasses.dataclass
class Configs:
    """What `build_configs` returns: the two configs, the run options, and which keys the user set."""

    model: ModelConfig
    train: TrainConfig
    run: RunOptions
    explicit: frozenset[str]  # keys given by a flag or the --config file (not by a preset or a default)

    def __iter__(self):  # model, train, run = build_configs(...)
        return iter((self.model, self.train, self.run))


def build_configs(args: argparse.Namespace, file_values: dict, cli: str, demo: bool = False) -> Configs:
    """Flags override the YAML file, which overrides the demo preset (with demo=True) and the defaults; unchecked."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    run_fields = {f.name: f for f in cli_fields(cli)}
    unknown = set(file_values) - model_fields - train_fields - set(run_fields)
    if unknown:
        raise UsageError(f"--config: unknown option(s) {', '.join(sorted(unknown))}")
    values = {**(DEMO_PRESET if demo else {}), **file_values}
    explicit = set(file_values)
    for name in model_fields | train_fields | set(run_fields):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
            explicit.add(name)
    model = ModelConfig(**{k: v for k, v in values.items() if k in model_fields})
    train = TrainConfig(**{k: v for k, v in values.items() if k in train_fields})
    if isinstance(train.betas, list):
        train.betas = tuple(train.betas)
    run = {}
    for name, f in run_fields.items():
        if name in values:
            run[name] = f.metadata["convert"](values[name]) if f.metadata["convert"] else values[name]
            choices = f.metadata["argparse"].get("choices")
            if choices and run[name] not in choices:  # a YAML value argparse did not see
                raise UsageError(f"{flag(name)} must be one of {', '.join(choices)}, got {values[name]!r}")
    return Configs(model, train, RunOptions(**run), frozenset(explicit))


def check_configs(model_cfg: ModelConfig, train_cfg: TrainConfig, run: RunOptions) -> None:
    """Every check that needs no data and no world size: once per start."""
    model_cfg.validate()
    train_cfg.validate()
    check_fits(model_cfg, train_cfg)
    run.validate()


# ---- the run's steps ------------------------------------------------------------------------------

@dataclass(frozen=True)
class StepPlan:
    steps_per_epoch: int
    total_steps: int  # optimizer steps of the whole run


def check_world_sizes(train_cfg: TrainConfig, world_sizes: Iterable[int], where: str = "") -> None:
    valid = valid_world_sizes(train_cfg.global_batch_size, train_cfg.micro_batch_size)
    bad = [w for w in world_sizes if w not in valid]
    if bad:
        raise UsageError(f"{where}world size(s) {', '.join(map(str, bad))} cannot keep global_batch_size "
                         f"{train_cfg.global_batch_size} with micro_batch_size {train_cfg.micro_batch_size}; "
                         f"valid world sizes: {', '.join(map(str, valid)) or 'none'}")


def plan_steps(train_cfg: TrainConfig, num_sequences: int, val_samples: int = 0, world_sizes: Iterable[int] = (1,),
               where: str = "") -> StepPlan:
    """The steps of a run on `num_sequences` rows (`val_samples` held out) at `world_sizes`; refused when a world size
    breaks the global batch, the data does not fill one, or the warmup does not fit the steps."""
    check_world_sizes(train_cfg, world_sizes)
    D.check_val_samples(num_sequences, val_samples)
    num_train = num_sequences - val_samples  # split_ids' training ids, counted without making them
    per_epoch = D.steps_per_epoch(num_train, train_cfg.global_batch_size)
    if per_epoch == 0:
        raise D.DataError(f"{where}{num_train} training sequences do not fill one global batch of "
                          f"{train_cfg.global_batch_size}")
    total = train_cfg.max_steps or per_epoch * train_cfg.epochs
    problems = train_cfg.steps_problems(total)
    if problems:
        raise ConfigError(problems)
    return StepPlan(per_epoch, total)


__all__ = ["BOTH", "PRETRAIN", "TRAIN", "Configs", "RunOptions", "StepPlan", "add_run_flags", "build_configs",
           "check_configs", "check_world_sizes", "parse_cpus", "parse_num_workers", "parse_resources", "plan_steps"]
