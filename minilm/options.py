"""The options a run adds to the two configs, declared once: a field's metadata makes its flag, its YAML key and its
check, and the same dataclass is what the Trainer and every Ray worker get. `plan_steps` works out a run's steps."""

from __future__ import annotations

import argparse
import dataclasses
import math
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from . import data as D
from .config import (
    CHOICES,
    FIELD_HELP,
    WAS_BOOL,
    ConfigError,
    ModelConfig,
    TrainConfig,
    check_fits,
    field_kinds,
    from_bool,
)
from .errors import UsageError
from .safety import redact

# What a run on the built-in demo corpus (no --data) uses: a small model that trains in a few minutes
# on 2 CPUs. With --data, the dataclasses' defaults (MiniMind's) apply, and the data's seq_len and vocab_size;
# flags and --config override both.
DEMO_PRESET = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "seq_len": 256, "micro_batch_size": 8, "global_batch_size": 32, "lr": 1e-3, "warmup_steps": 0,
    "log_every": 10, "checkpoint_every": 50, "max_steps": 100,
}


TRACKER_HELP = "experiment tracker(s) rank 0 logs every reported metric to, repeated or comma-separated (docs/tracking.md)"
TIMEOUT_HELP = ("seconds a rank waits in one collective for the others before the run fails (a rank hung or gone); "
                "default 600 on GPUs (NCCL), 1800 on CPUs (gloo)")


def field_default(f: dataclasses.Field):
    return f.default if f.default is not dataclasses.MISSING else f.default_factory()


def option(default=None, help: str = "", *, minimum=None, convert=None, **argparse_kwargs):
    """A run option; with `help`, a flag. `minimum` 0 means > 0; `convert` turns a flag's or YAML's value into the field's."""
    meta = {"help": help, "minimum": minimum, "convert": convert, "argparse": argparse_kwargs}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)  # a copy, with its items
    return field(default=default, metadata=meta)


@dataclass
class RunOptions:
    """What a run adds to the two configs: the flags both `minilm.train` and `ray_jobs.pretrain` have, then what the
    entry point fills in. Each entry point's own flags are a subclass (`LocalOptions`, `RayOptions`)."""

    data: str | None = option(help="a folder written by ray_jobs.prepare, or a remote URI (copied to the node once)")
    name: str | None = option(help="run name (default: the run folder's name)")
    resume: str = option("auto", "auto: continue the run's newest complete checkpoint; never; or a checkpoint PATH",
                         metavar="auto|never|PATH")
    abandon_newer: bool = option(False, "with --resume never or an older PATH: move the run folder's newer checkpoints "
                                 "into abandoned-<time>/ (kept, never continued) instead of refusing", action="store_true")
    keep_checkpoints: int = option(3, "the newest N complete checkpoints are kept", minimum=1)
    exit_after_steps: int | None = option(help="checkpoint and exit cleanly at the first optimizer step >= N", minimum=1)
    exit_after_minutes: float | None = option(help="checkpoint and exit cleanly this many minutes after the command "
                                              "started (worker restarts included)", minimum=0)
    collective_timeout_s: float | None = option(help=TIMEOUT_HELP, minimum=1)  # TorchConfig takes whole s
    tracker: list[str] | None = option(help=TRACKER_HELP, action="append", metavar="none|tensorboard|mlflow|wandb")
    mlflow_uri: str | None = option(help="MLflow tracking URI (default: sqlite:///RUN_DIR/mlflow.db)")
    wandb_project: str | None = option(help="W&B project (default minilm); WANDB_MODE=offline works")
    allow_config_change: bool = option(False, "resume even though the schedule or optimizer settings differ from the "
                                       "checkpoint's (lr, warmup, steps, betas, weight decay, ...): each change is "
                                       "logged and used", action="store_true")
    dry_run: bool = option(False, "every check of the run (flags, configs, data, run folder and --resume, cluster), "
                           "then exit: nothing is started or written", action="store_true")
    run_dir: str | None = None  # checkpoints, metrics.jsonl, world_size.csv (local storage)
    run_id: str = ""
    resume_path: str | None = None  # what the run continues when its folder holds no checkpoint (decide_resume's)
    started_at: float | None = None  # when the command started (time.time()): --exit-after-minutes counts from it
    trackers: list[str] = field(default_factory=list)  # --tracker, checked
    tracker_group: str | None = None  # one W&B group / MLflow tag for the trials of a sweep
    test_hooks: dict | None = None  # minilm.testing.FaultHooks, only ever set by a test
    eval_task_names: list[str] = field(default_factory=list)  # tasks scored beside training (ray_jobs.evaluator)
    eval_wait_s: float = 0.0  # after the last step, how long rank 0 waits for the last checkpoint's scores
    optimizer_why: str = ""  # why --optimizer auto chose the run's optimizer (minilm.step.choose_optimizer)
    from_manifest: list[str] = field(default_factory=list)  # seq_len, vocab_size not given: --data's manifest's

    def tracker_settings(self) -> dict:
        return {"mlflow_uri": self.mlflow_uri, "wandb_project": self.wandb_project, "group": self.tracker_group}

    def validate(self) -> RunOptions:  # each field's type and minimum
        kinds = field_kinds(type(self))
        for f in dataclasses.fields(self):
            low, value = f.metadata.get("minimum"), getattr(self, f.name)
            if value is None and f.metadata.get("help") and type(None) not in kinds[f.name]:
                raise UsageError(f"{flag(f.name)} needs a value, got null (leave it out for the default, "
                                 f"{field_default(f)})")
            if low is None or value is None:
                continue
            if int in kinds[f.name]:
                if not isinstance(value, int) or isinstance(value, bool) or value < low:
                    raise UsageError(f"{flag(f.name)} must be an integer >= {low}, got {value!r}")
            elif isinstance(value, int) and abs(value) >= 1e300:  # a float field takes an int; this one would overflow
                raise UsageError(f"{flag(f.name)} must be a number below 1e300, got {value}")
            elif not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and
                      (value > 0 if low == 0 else value >= low)):
                raise UsageError(f"{flag(f.name)} must be {'> 0' if low == 0 else f'>= {low}'}, got {value!r}")
        if not self.resume.strip():  # '' would be the working directory taken for a checkpoint
            raise UsageError(f"--resume must be auto, never or a checkpoint PATH, got {self.resume!r}")
        if self.abandon_newer and self.resume == "auto":  # auto continues the newest: there is nothing to abandon
            raise UsageError("--abandon-newer goes with --resume never or --resume PATH (an older checkpoint), not auto")
        return self


@dataclass
class RunSpec:
    """What every process of a run gets, as one object: the two configs, the run options and the step plan. It travels
    as `to_dict()`'s plain values, which the Ray dashboard shows as the run's train_loop_config."""

    model: ModelConfig
    train: TrainConfig
    options: RunOptions
    steps: StepPlan

    def to_dict(self) -> dict:
        return {"model": self.model.to_dict(), "train": self.train.to_dict(), "run": dataclasses.asdict(self.options),
                "steps": dataclasses.asdict(self.steps)}

    @classmethod
    def from_dict(cls, d: dict, options: type[RunOptions]) -> RunSpec:
        return cls(ModelConfig.from_dict(d["model"]), TrainConfig.from_dict(d["train"]), options(**d["run"]),
                   StepPlan(**d["steps"]))


def flag_fields(cls: type[RunOptions]) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.metadata.get("help")]


def add_run_flags(parser: argparse.ArgumentParser, cls: type[RunOptions], skip: Iterable[str] = ()) -> None:
    """One flag per field of `cls` with a help text (but those in `skip`), then those of the two configs
    (`add_config_flags`), each defaulting to None so that `build_configs` tells a given value from a default."""
    kinds = field_kinds(cls)
    group = parser.add_argument_group("run")
    for f in flag_fields(cls):
        if f.name in skip:
            continue
        meta = f.metadata
        kwargs = {"dest": f.name, "default": None, "help": with_default(meta["help"], field_default(f)),
                  **meta["argparse"]}
        aliases = kwargs.pop("aliases", [])
        if "action" not in kwargs:
            kwargs["type"] = str if meta["convert"] else (kinds[f.name] - {type(None)}).pop()
        group.add_argument(flag(f.name), *aliases, **kwargs)
    add_config_flags(parser)


def with_default(text: str, default) -> str:
    """A flag's help and its default (0 and False too; unset for None), unless the help already says it."""
    if "default" in text:
        return text
    if isinstance(default, dict):
        default = ",".join(f"{k}={v:g}" for k, v in default.items()) or "none"
    return f"{text} (default: {'unset' if default is None else default})"


class Configs(typing.NamedTuple):
    """What `build_configs` returns: the two configs and the run options (model, train, run = ...)."""

    model: ModelConfig
    train: TrainConfig
    run: RunOptions


def build_configs(args: argparse.Namespace, file_values: dict, cls: type[RunOptions], demo: bool = False) -> Configs:
    """Flags override the YAML file, which overrides the demo preset (with demo=True) and the defaults; unchecked."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    run_fields = {f.name: f for f in flag_fields(cls)}
    unknown = set(file_values) - model_fields - train_fields - set(run_fields)
    if unknown:
        raise UsageError(f"--config: unknown option(s) {', '.join(sorted(unknown))}")
    values = {**(DEMO_PRESET if demo else {}), **file_values}
    for name in model_fields | train_fields | set(run_fields):
        if getattr(args, name, None) is not None:
            values[name] = getattr(args, name)
    model = ModelConfig(**{k: v for k, v in values.items() if k in model_fields})
    train = TrainConfig(**{k: v for k, v in values.items() if k in train_fields})
    run = {}
    for name, f in run_fields.items():
        if name in values:
            run[name] = f.metadata["convert"](values[name]) if f.metadata["convert"] else values[name]
            choices = f.metadata["argparse"].get("choices")
            if choices and run[name] not in choices:  # a YAML value argparse did not see
                raise UsageError(f"{flag(name)} must be one of {', '.join(choices)}, got {values[name]!r}")
    opts = cls(**run)
    if values.get("data"):  # what the run does not set, the data's manifest does (data.fit_configs)
        opts.from_manifest = [name for name in ("seq_len", "vocab_size") if name not in values]
    return Configs(model, train, opts)


def check_configs(model_cfg: ModelConfig, train_cfg: TrainConfig, run: RunOptions) -> None:
    """Every check that needs no data and no world size: once per start."""
    model_cfg.validate()
    train_cfg.validate()
    if "seq_len" not in run.from_manifest:  # else once --data's manifest has set it (minilm.run.check_run)
        check_fits(model_cfg, train_cfg)
    run.validate()


@dataclass(frozen=True)
class StepPlan:
    steps_per_epoch: int
    total_steps: int  # optimizer steps of the whole run


def check_world_sizes(train_cfg: TrainConfig, world_sizes: Iterable[int], where: str = "") -> None:
    """Any world size from 1 to global_batch_size keeps the global batch (uneven sizes take uneven slices)."""
    bad = [w for w in world_sizes if not 1 <= w <= train_cfg.global_batch_size]
    if bad:
        raise UsageError(f"{where}world size(s) {', '.join(map(str, bad))} cannot keep global_batch_size "
                         f"{train_cfg.global_batch_size}: every worker needs at least one sequence; valid world "
                         f"sizes: 1-{train_cfg.global_batch_size}")


def plan_steps(train_cfg: TrainConfig, num_sequences: int, world_sizes: Iterable[int] = (1,), where: str = "") -> StepPlan:
    """The steps of a run on `num_sequences` rows (`val_samples` of them held out) at `world_sizes`; refused when a
    world size breaks the global batch, the data does not fill one, or the warmup does not fit the steps."""
    check_world_sizes(train_cfg, world_sizes)
    D.check_val_samples(num_sequences, train_cfg.val_samples)
    num_train = num_sequences - train_cfg.val_samples  # split_ids' training ids, counted without making them
    per_epoch = D.steps_per_epoch(num_train, train_cfg.global_batch_size)
    if per_epoch == 0:
        raise D.DataError(f"{where}{num_train} training sequences do not fill one global batch of "
                          f"{train_cfg.global_batch_size}")
    total = train_cfg.max_steps or per_epoch * train_cfg.epochs
    problems = train_cfg.steps_problems(total)
    if problems:
        raise ConfigError(problems)
    return StepPlan(per_epoch, total)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ModelConfig / TrainConfig field (--hidden-size...), defaulting to None so that `build_configs`
    tells a given value from a default; the help is config.FIELD_HELP's, with the default and the demo preset's."""
    for cls, title in ((ModelConfig, "model"), (TrainConfig, "training")):
        group = parser.add_argument_group(f"{title} config (every field of {cls.__name__})")
        kinds = field_kinds(cls)
        for f in dataclasses.fields(cls):
            default = field_default(f)
            text = with_default(FIELD_HELP[f.name], " ".join(map(str, default)) if f.name == "betas" else default)
            if f.name in DEMO_PRESET and DEMO_PRESET[f.name] != default:
                text = f"{text[:-1]}; {DEMO_PRESET[f.name]} on the built-in demo corpus)"
            kwargs: dict = {"default": None, "dest": f.name, "help": text}
            if kinds[f.name] == {bool}:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.name == "betas":
                kwargs.update(nargs=2, type=float, metavar=("BETA1", "BETA2"))
            elif f.name in CHOICES:
                kwargs.update(choices=list(CHOICES[f.name]))
            elif kinds[f.name] == {int, str}:  # a size or a word: --micro-batch-size auto
                kwargs.update(type=int_or_word, metavar="N|auto")
            else:
                kwargs["type"] = (kinds[f.name] - {type(None)}).pop()
            if f.name in WAS_BOOL:  # its old flags: bare, the old true; --no-X, the old false
                kwargs.update(nargs="?", const=WAS_BOOL[f.name][1])
                group.add_argument(f"--no-{flag(f.name)[2:]}", dest=f.name, action="store_const",
                                   const=WAS_BOOL[f.name][0], help=argparse.SUPPRESS)
            group.add_argument(flag(f.name), **kwargs)


def int_or_word(text: str) -> int | str:
    """An `int | str` field's flag or YAML text (--micro-batch-size 8 or auto): an integer's digits as the int, any
    other word as is (the config's check names a wrong one)."""
    try:
        return int(text)
    except ValueError:
        return text


def load_yaml(path: str | None) -> dict:
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except (OSError, yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: a bad date, bytes not UTF-8
        raise UsageError(f"--config {path}: not valid YAML ({' '.join(str(e).split())[:300]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise UsageError(f"--config {path}: option names must be strings, got {bad[0]!r}")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    return {k: yaml_value(k, v, path) for k, v in data.items()}


PER_START = ("resume", "abandon_newer", "allow_config_change", "exit_after_steps", "exit_after_minutes", "dry_run")


def dump_yaml(model: ModelConfig, train: TrainConfig, opts: RunOptions, header: str = "") -> str:
    """The configs as a --config file: every config field, and each run option that is a flag and set, but those
    of one start (PER_START); a URI's credentials as *** (redact), which a rerun gives again as flags."""
    run = {f.name: getattr(opts, f.name) for f in flag_fields(type(opts))
           if f.name not in PER_START and getattr(opts, f.name) is not None}
    shown = {k: redact(v) if isinstance(v, str) else v for k, v in run.items()}
    if shown != run:
        header += "# *** stands for a credential: give that option again as a flag\n"
    return header + yaml.safe_dump({**model.to_dict(), **train.to_dict(), **shown}, sort_keys=False)


def yaml_value(key: str, value, path: str):
    """A YAML value as its flag would give it: PyYAML reads `lr: 5e-4` and `rope_theta: 1e6` as strings, and a
    number where a string goes (`name: 123`) is that number's text; anything else a flag cannot give is refused."""
    value, types = from_bool(key, value), set()
    for cls in (ModelConfig, TrainConfig, RunOptions, *RunOptions.__subclasses__()):  # an entry point's own flags
        f = cls.__dataclass_fields__.get(key)
        if f is not None and not f.metadata.get("convert"):  # a field with a convert parses any value itself
            types = field_kinds(cls)[key]
    if types == {int, str}:
        return int_or_word(value) if isinstance(value, str) else value
    if isinstance(value, str) and types & {int, float} and str not in types:
        try:
            return float(value) if float in types else int(value)
        except ValueError:
            return value  # the config's own check names it
    if str in types and value is not None and not isinstance(value, str):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise UsageError(f"--config {path}: {key} must be a string, got {value!r}"[:300])
    return value
