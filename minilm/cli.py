"""Command-line plumbing shared by every entrypoint (`minilm.train`, `ray_jobs.*`): exit codes, the one
usage-error class, config flags named after the dataclass fields, YAML config files. No Ray here."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

import yaml

from .config import CHECKPOINT_MODES, DTYPES, ModelConfig, TrainConfig, field_kinds
from .safety import redact

EXIT_USAGE = 2  # bad flag, bad config, bad data: nothing was started
EXIT_FAILED = 1  # training (or a Ray task) started and failed
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM of the driver

# What a run on the built-in demo corpus (no --data) uses: a small model that trains in a few minutes
# on 2 CPUs. With --data, the dataclasses' defaults (MiniMind's) apply; flags and --config override both.
DEMO_PRESET = {
    "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "seq_len": 256, "micro_batch_size": 8, "global_batch_size": 32, "lr": 1e-3, "warmup_steps": 0,
    "log_every": 10, "checkpoint_every": 50, "max_steps": 100,
}


class UsageError(Exception):
    """A mistake on the command line, in a config file or in the inputs: `error: ...`, exit 2 (and, when
    given, one `hint: ...` line saying what to do)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"error: {redact(message)}", file=sys.stderr, flush=True)
    return code


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser, preset: dict | None = None) -> None:
    """One flag per ModelConfig / TrainConfig field, named after it (--hidden-size, --warmup-steps...).

    Every flag defaults to None, so `build_configs` can tell a value the user gave from a default;
    the help shows the dataclass default, and the demo preset's value where it differs."""
    preset = DEMO_PRESET if preset is None else preset
    for cls, title in ((ModelConfig, "model"), (TrainConfig, "training")):
        group = parser.add_argument_group(f"{title} config (every field of {cls.__name__})")
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else None
            text = f"default: {default}"
            if f.name in preset and preset[f.name] != default:
                text += f" ({preset[f.name]} on the built-in demo corpus)"
            hint = hints[f.name]
            kwargs: dict = {"default": None, "dest": f.name, "help": text}
            if hint is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif f.name == "betas":
                kwargs.update(nargs=2, type=float, metavar=("BETA1", "BETA2"))
            elif f.name == "dtype":
                kwargs.update(choices=list(DTYPES))
            elif f.name == "checkpoint_mode":
                kwargs.update(choices=list(CHECKPOINT_MODES))
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
    except (OSError, yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: a bad date, bytes not UTF-8
        raise UsageError(f"--config {path}: not valid YAML ({' '.join(str(e).split())[:300]})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--config {path}: expected a mapping of option: value, got {type(data).__name__}")
    bad = [k for k in data if not isinstance(k, str)]
    if bad:
        raise UsageError(f"--config {path}: option names must be strings, got {bad[0]!r}")
    data = {k.replace("-", "_"): v for k, v in data.items()}
    return {k: yaml_value(k, v, path) for k, v in data.items()}


def yaml_value(key: str, value, path: str):
    """A YAML value as its flag would give it: PyYAML reads `lr: 5e-4` and `rope_theta: 1e6` as strings, and a
    number where a string goes (`name: 123`) is that number's text; anything else a flag cannot give is refused."""
    from .options import RunOptions  # options builds on this module

    types = set()
    for cls in (ModelConfig, TrainConfig, RunOptions, *RunOptions.__subclasses__()):  # an entry point's own flags
        f = cls.__dataclass_fields__.get(key)
        if f is not None and not f.metadata.get("convert"):  # a field with a convert parses any value itself
            types = field_kinds(cls)[key]
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
