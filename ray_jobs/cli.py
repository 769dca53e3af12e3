"""Command-line plumbing shared by the Ray entrypoints: config flags, YAML, clean errors, local Ray."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import typing
from pathlib import Path

import yaml

from minilm.config import ModelConfig, TrainConfig

EXIT_USAGE = 2  # bad flag, bad config, bad data: nothing was started
EXIT_FAILED = 1  # training started and failed

# What a run with no arguments uses: a small model that trains in a few minutes on 2 CPUs.
# ModelConfig/TrainConfig keep MiniMind's defaults; the CLI starts from this laptop preset.
DEMO_PRESET = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "seq_len": 256, "micro_batch_size": 8, "global_batch_size": 32, "lr": 1e-3, "warmup_steps": 20,
    "log_every": 10, "checkpoint_every": 50,
}
DEMO_ONLY = {"max_steps": 100}  # only when training on the built-in corpus; with --data, epochs count


class UsageError(Exception):
    """A mistake on the command line or in a config file."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per ModelConfig / TrainConfig field, named after it (--hidden-size, --warmup-steps...)."""
    for cls, title in ((ModelConfig, "model"), (TrainConfig, "training")):
        group = parser.add_argument_group(f"{title} config (every field of {cls.__name__})")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = DEMO_PRESET.get(f.name, DEMO_ONLY.get(f.name, f.default))
            hint = hints[f.name]
            kwargs: dict = {"default": None, "dest": f.name, "help": f"default: {default}"}
            if hint is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.name == "betas":
                kwargs.update(nargs=2, type=float, metavar=("BETA1", "BETA2"))
            elif f.name == "dtype":
                kwargs.update(choices=["auto", "bf16", "fp16", "fp32"])
            else:
                base = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
                kwargs["type"] = base[0]
            group.add_argument(flag(f.name), **kwargs)


def load_yaml(path: str | None) -> dict:
    if not path:
        return {}
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--config {path}: file not found")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise UsageError(f"--config {path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    return {k.replace("-", "_"): v for k, v in data.items()}


def build_configs(args: argparse.Namespace, file_values: dict, other_keys: set[str],
                  demo: bool = False) -> tuple[ModelConfig, TrainConfig, dict]:
    """Flags override the YAML file, which overrides the demo preset; returns (model, train, the rest)."""
    model_fields = {f.name for f in dataclasses.fields(ModelConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = set(file_values) - model_fields - train_fields - other_keys
    if unknown:
        raise UsageError(f"--config: unknown option(s) {', '.join(sorted(unknown))}")
    values = {**DEMO_PRESET, **(DEMO_ONLY if demo else {}), **file_values}
    for name in model_fields | train_fields | other_keys:
        v = getattr(args, name, None)
        if v is not None:
            values[name] = v
    model = ModelConfig(**{k: v for k, v in values.items() if k in model_fields})
    train = TrainConfig(**{k: v for k, v in values.items() if k in train_fields})
    if isinstance(train.betas, list):
        train.betas = tuple(train.betas)
    rest = {k: values[k] for k in other_keys if k in values}
    return model, train, rest


def parse_num_workers(spec: str) -> tuple[int, int]:
    """'N' or 'MIN-MAX' -> (min, max)."""
    try:
        if "-" in str(spec):
            lo, hi = (int(x) for x in str(spec).split("-", 1))
        else:
            lo = hi = int(spec)
    except ValueError:
        raise UsageError(f"--num-workers {spec!r}: expected N or MIN-MAX, e.g. 2 or 2-8") from None
    if lo < 1 or hi < lo:
        raise UsageError(f"--num-workers {spec!r}: need 1 <= MIN <= MAX")
    return lo, hi


def ensure_ray(num_cpus: int | None = None, *, quiet: bool = True) -> None:
    """Connect to the cluster in RAY_ADDRESS (ray job submit sets it) or start a local Ray.

    A local Ray gets more logical CPUs than cores: training workers that take every CPU would
    starve the Ray Data tasks that feed them (a 2-core Ray with 2 workers never starts reading).
    """
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        return
    cores = os.cpu_count() or 2
    # address="local": a new Ray even when another one runs on this machine (join a cluster via RAY_ADDRESS).
    ray.init(address="local", num_cpus=num_cpus or max(8, 2 * cores), log_to_driver=True, include_dashboard=None,
             logging_level="WARNING" if quiet else "INFO")


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code

