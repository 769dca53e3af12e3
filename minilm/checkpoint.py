"""Resume state and weight exports: written atomically, verified before loading, safe to load.

A resume checkpoint is a folder:

    model.safetensors     fp32 master weights (every state-dict key, MiniMind names)
    optimizer.pt          AdamW state        (torch.save of tensors and numbers: weights_only-loadable)
    scaler.pt             GradScaler state
    state.json            optimizer_step, epoch, samples_seen, world_size, micro_batch_size,
                          accumulation_steps, global_batch_size, configs, fingerprints, run ids, ...
    COMPLETE.json         written last: SHA-256 of every file above. No marker, no load.

A weights export (for inference, separate from resume) is `model.safetensors` in half precision
+ `config.json` + `tokenizer.json`, loadable with `minilm.load_pretrained(DIR)`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .checkpoint_files import (  # noqa: F401 (is_disk_full, write_error, write_marker: callers import them here)
    MARKER,
    CheckpointError,
    is_disk_full,
    torch_save,
    write_bytes,
    write_error,
    write_files,
    write_marker,
    write_safetensors,
)
from .config import ModelConfig
from .data import cache_root, file_sha256
from .data.verified import file_key, node_lock
from .step import DTYPE_NAMES

RESUME_FILES = ("model.safetensors", "optimizer.pt", "scaler.pt", "state.json")
# state.json's format: a change that an older reader would misread bumps it (and adds a fixture under
# tests/fixtures/). A state.json without the key was written before it existed: format 1.
STATE_FORMAT = 1
# What a resume reads from state.json (train_config must hold the seed).
STATE_KEYS = ("optimizer_step", "world_size", "accumulation_steps", "global_batch_size", "model_config",
              "train_config", "data_fingerprint", "nonfinite_guard")


# ---- resume state -------------------------------------------------------------------------------

def model_tensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's state dict as safetensors takes it: on the CPU, each key its own copy (tied weights
    share storage, which safetensors refuses)."""
    return {k: (v.detach().to(dtype) if dtype else v.detach()).cpu().contiguous().clone() for k, v in state_dict.items()}


def save_resume_state(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scaler: torch.amp.GradScaler, state: dict[str, Any], hooks=None) -> Path:
    """`write_resume_state` of the live model, optimizer and scaler (the training loop writes a snapshot)."""
    return write_resume_state(path, model_state=model_tensors(model.state_dict()),
                              optimizer_state=optimizer.state_dict(), scaler_state=scaler.state_dict(), state=state,
                              hooks=hooks)


def write_resume_state(path: str | os.PathLike, *, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                       scaler_state: dict, state: dict[str, Any], hooks=None) -> Path:
    """Write a complete resume checkpoint into the (new, empty or missing) folder `path`.

    A failed write (a full disk, a lost mount) leaves no marker, so `verify` refuses what was left and
    every earlier checkpoint stays as it was.
    """
    state = {"format_version": STATE_FORMAT, **state}
    writers = {
        "model.safetensors": lambda f: write_safetensors(f, model_state),
        "optimizer.pt": lambda f: torch_save(optimizer_state, f),
        "scaler.pt": lambda f: torch_save(scaler_state, f),
        "state.json": lambda f: write_bytes(f, json.dumps(state, indent=2, sort_keys=True).encode()),
    }
    write_files(Path(path), writers, state.get("optimizer_step"), hooks)
    return Path(path)


def verify(path: str | os.PathLike, once_per_node: bool = False) -> None:
    """Raise CheckpointError unless `path` holds a complete checkpoint whose files match their hashes.

    `once_per_node` (a resume): the first process of a node hashes under a lock and leaves a stamp in
    the node's cache (the marker's SHA-256, each file's size, mtime and inode), which the other ranks
    trust; any change to a file or to the marker makes them hash again.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {MARKER} is missing (the write did not finish)")
    raw = marker.read_bytes()
    try:
        files = json.loads(raw)["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is unreadable ({e})") from None
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    if not once_per_node:
        _check_hashes(path, files)
        return
    key = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32]
    stamps = cache_root() / "verified-checkpoints"
    with node_lock(stamps / f"{key}.lock"):
        stamp = {"marker_sha256": hashlib.sha256(raw).hexdigest(), "files": {name: file_key(path / name) for name in files}}
        try:
            if json.loads((stamps / f"{key}.json").read_text()) == stamp:
                return
        except (OSError, ValueError):
            pass
        _check_hashes(path, files)
        try:
            tmp = stamps / f"{key}.json.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(stamp))
            os.replace(tmp, stamps / f"{key}.json")
        except OSError:
            pass  # no writable cache: the next process hashes again


def _check_hashes(path: Path, files: dict[str, str]) -> None:
    for name, digest in files.items():
        if file_sha256(path / name) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its SHA-256 in {MARKER}")


@dataclass
class ResumeState:
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    scaler_state: dict
    state: dict[str, Any]


def load_resume_state(path: str | os.PathLike, map_location: str | torch.device = "cpu",
                      keys: tuple[str, ...] = (), once_per_node: bool = False) -> ResumeState:
    """`verify`, then load a resume checkpoint (weights_only: never arbitrary objects).

    `keys`: what state.json must hold (a resume passes STATE_KEYS; an export needs only model_config).
    """
    path = Path(path)
    verify(path, once_per_node)
    try:
        return ResumeState(
            model_state=load_file(str(path / "model.safetensors"), device=str(map_location)),
            optimizer_state=torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True),
            scaler_state=torch.load(path / "scaler.pt", map_location="cpu", weights_only=True),
            state=read_state(path, keys),
        )
    except CheckpointError:
        raise
    except Exception as e:  # hashes matched, so this is a format problem, not a torn write
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(e).__name__}: {e}") from None


def read_state(path: str | os.PathLike, keys: tuple[str, ...] = STATE_KEYS) -> dict[str, Any]:
    """A checkpoint's state.json, refused with one CheckpointError line when this version cannot use it:
    unreadable, written in a newer format, or lacking one of `keys` (never a KeyError later)."""
    f = Path(path) / "state.json"
    try:
        state = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: state.json is unreadable ({e})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: state.json holds a {type(state).__name__}, not a mapping")
    version = state.get("format_version", 1)
    if not isinstance(version, int) or version > STATE_FORMAT or version < 1:
        raise CheckpointError(f"checkpoint {path} has state.json format {version!r}, and this version of minilm "
                              f"reads formats 1 to {STATE_FORMAT}: resume it with the minilm that wrote it (or a "
                              f"newer one)")
    missing = [k for k in keys if k not in state]
    if "train_config" in keys and "train_config" in state and "seed" not in (state["train_config"] or {}):
        missing.append("train_config.seed")
    if missing:
        raise CheckpointError(f"checkpoint {path}: state.json lacks {', '.join(missing)} (format {version}): "
                              f"it was not written by minilm, or was edited; resume another checkpoint")
    return state


def resume_problems(state: dict[str, Any], model_config: ModelConfig, global_batch_size: int, seed: int,
                    data_fingerprint: str, dtype: str | None = None, optimizer: str | None = None) -> list[str]:
    """Why a run with these settings cannot continue from a checkpoint's state.json (empty: it can)."""
    problems = []
    before = checkpoint_dtype(state)
    if dtype not in (None, "auto") and before and dtype != before and "fp16" in (dtype, before):
        problems.append(f"dtype {dtype} != {before} in the checkpoint (fp16's GradScaler state has no counterpart "
                        f"in bf16 or fp32; only fp32 <-> bf16 can change mid-run, with --allow-config-change)")
    if state["global_batch_size"] != global_batch_size:
        problems.append(f"global_batch_size {global_batch_size} != {state['global_batch_size']} in the checkpoint "
                        f"(the global batch is the invariant of a run)")
    # A field added to ModelConfig since the checkpoint was written (e.g. document_mask) has its default there.
    saved_model = {**ModelConfig().to_dict(), **state["model_config"]}
    if saved_model != model_config.to_dict():
        changed = sorted(k for k, v in model_config.to_dict().items() if saved_model.get(k) != v)
        problems.append(f"the model config differs from the checkpoint's ({', '.join(changed)})")
    if state["data_fingerprint"] != data_fingerprint:
        problems.append(f"the data fingerprint {data_fingerprint[:12]} differs from the checkpoint's "
                        f"{state['data_fingerprint'][:12]} (other --data, or data made with another tokenizer)")
    if state["train_config"]["seed"] != seed:
        problems.append(f"seed {seed} != {state['train_config']['seed']} in the checkpoint")
    saved_optimizer = state["train_config"].get("optimizer", "adamw")
    if optimizer is not None and optimizer != saved_optimizer:
        problems.append(f"optimizer {optimizer} != {saved_optimizer} in the checkpoint (its state has no "
                        f"counterpart in the other optimizer)")
    return problems


TORCH_NAMES = {str(dtype).removeprefix("torch."): name for dtype, name in DTYPE_NAMES.items()}  # "bfloat16": "bf16"


def checkpoint_dtype(state: dict[str, Any]) -> str | None:
    """The precision a checkpoint's run trained in (None for an old checkpoint that left it at auto)."""
    dtype = state.get("dtype") or state.get("train_config", {}).get("dtype")
    if dtype in (None, "auto"):
        return None
    return TORCH_NAMES.get(dtype, dtype)  # state.json names torch's dtype ("bfloat16"), a train_config the flag's


# Train-config fields added after checkpoints were first written, and the value every checkpoint that lacks
# one ran with: a resume continues that value (Trainer.restore), whatever today's default is.
PREDATED_VALUES = {"schedule": "cosine"}

# Train-config fields a resume may change without changing the optimisation; any other field needs
# --allow-config-change, since it changes the schedule or the optimizer.
SAFE_TO_CHANGE = frozenset({"log_every", "checkpoint_every", "checkpoint_every_minutes", "checkpoint_mode",
                            "export_every", "compile", "activation_checkpointing", "micro_batch_size",
                            "max_nonfinite_steps"})


@dataclass(frozen=True)
class ConfigChange:
    name: str
    before: Any
    after: Any
    safe: bool

    def __str__(self) -> str:
        return f"{self.name} {self.before} -> {self.after}"


def config_changes(state: dict[str, Any], train_config, val_samples: int | None = None) -> list[ConfigChange]:
    """What a resumed run changes against the checkpoint's train config (global batch and seed are
    `resume_problems`' business). The held-out slice (val_samples) decides which ids are trained on: a change
    there reorders the data, so it counts as unsafe too."""
    saved = state.get("train_config", {})
    new = train_config.to_dict()
    changes = []
    for name in sorted(new):
        if name in ("global_batch_size", "seed") or name not in saved:
            continue
        before, after = saved[name], new[name]
        if name == "dtype":
            before = checkpoint_dtype(state)
            if after == "auto" or before is None:
                continue
        if before != after:
            changes.append(ConfigChange(name, before, after, name in SAFE_TO_CHANGE))
    if val_samples is not None and state.get("val_samples") is not None and state["val_samples"] != val_samples:
        changes.append(ConfigChange("val_samples", state["val_samples"], val_samples, False))
    return changes


def checkpoint_dir_name(run_dir: str | os.PathLike | None, step: int) -> str:
    """checkpoint_<step>, or checkpoint_<step>_<k> when that folder exists (a step redone after falling back
    past a corrupt checkpoint must not write into it)."""
    name = f"checkpoint_{step:08d}"
    if run_dir is None:
        return name
    k, candidate = 0, name
    while (Path(run_dir) / candidate).exists():
        k += 1
        candidate = f"{name}_{k}"
    return candidate


def checkpoint_dirs(run_dir: str | os.PathLike | None) -> list[Path]:
    """The checkpoint folders of a local run folder, oldest first."""
    if run_dir is None or not Path(run_dir).is_dir():
        return []
    return sorted(p for p in Path(run_dir).glob("checkpoint_*") if p.is_dir())


def prune_checkpoints(run_dir: str | os.PathLike | None, keep: int, newest: Path | None = None,
                      log=print) -> list[Path]:
    """Keep the newest `keep` complete checkpoints (with a marker, or `newest`) of a local run folder.

    The older ones and the incomplete folders older than them are deleted and returned; one that cannot be
    deleted is logged and stays, since a failed delete must never stop a run.
    """
    dirs = checkpoint_dirs(run_dir)
    complete = [p for p in dirs if (p / MARKER).is_file() or (newest is not None and p == Path(newest))]
    if len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = []
    for old in dirs:
        if old.name >= oldest_kept.name:
            continue
        try:
            shutil.rmtree(old)
            removed.append(old)
        except OSError as e:
            log(f"warning: could not delete old checkpoint {old} (--keep-checkpoints {keep}): "
                f"{e.strerror or e}; it stays on disk, and the run goes on")
    return removed


def latest_complete(checkpoint_dirs: list[Path], log=print, once_per_node: bool = False) -> Path | None:
    """The newest complete checkpoint among `checkpoint_dirs` (sorted oldest first); says what it skips."""
    for p in reversed(checkpoint_dirs):
        try:
            verify(p, once_per_node)
            return p
        except CheckpointError as e:
            log(f"skipping checkpoint: {e}")
    return None


# ---- weight exports -----------------------------------------------------------------------------

def export_weights(path: str | os.PathLike, model: torch.nn.Module, config: ModelConfig,
                   tokenizer_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float16,
                   step: int | None = None) -> Path:
    """Half-precision safetensors + config.json (+ tokenizer.json), written to a temp folder and renamed.

    The weights are taken in eval mode, as MiniMind's loop does, since that is what inference sees; a
    failed write raises CheckpointError naming `step`.
    """
    was_training = model.training
    model.eval()
    try:
        state = model_tensors(model.state_dict(), dtype)
    finally:
        model.train(was_training)
    return write_weights_export(path, state, config, tokenizer_path, dtype, step)


def write_weights_export(path: str | os.PathLike, model_state: dict[str, torch.Tensor], config: ModelConfig,
                         tokenizer_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float16,
                         step: int | None = None) -> Path:
    """`export_weights` of a model state (CPU tensors, any float dtype: cast to `dtype` here)."""
    metadata = {"format": "pt", "dtype": str(dtype).removeprefix("torch.")}
    writers = {
        "model.safetensors": lambda f: write_safetensors(f, {k: v.to(dtype) for k, v in model_state.items()}, metadata),
        "config.json": lambda f: write_bytes(f, json.dumps(config.to_dict(), indent=2, sort_keys=True).encode()),
    }
    if tokenizer_path is not None:
        writers["tokenizer.json"] = lambda f: write_bytes(f, Path(tokenizer_path).read_bytes())
    write_files(Path(path), writers, step, via_tmp=True)
    return Path(path)


def export_minimind_pth(path: str | os.PathLike, model_state: dict[str, torch.Tensor]) -> Path:
    """MiniMind's inference format: a torch.save'd fp16 state dict (`pretrain_<hidden>[_moe].pth`)."""
    path = Path(path)
    torch.save({k: v.detach().half().cpu() for k, v in model_state.items()}, path)
    return path


def load_pretrained(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer or None) from a weights export folder."""
    from .model import MiniMindForCausalLM

    path = Path(path)
    verify(path)
    config = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    model = MiniMindForCausalLM(config)
    model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    model.to(device=device, dtype=dtype).eval()
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    return model, tokenizer
