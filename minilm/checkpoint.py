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

import contextlib
import errno
import hashlib
import io
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .config import ModelConfig
from .data import cache_root, file_sha256

MARKER = "COMPLETE.json"
RESUME_FILES = ("model.safetensors", "optimizer.pt", "scaler.pt", "state.json")
# state.json's format: a change that an older reader would misread bumps it (and adds a fixture under
# tests/fixtures/). A state.json without the key was written before it existed: format 1.
STATE_FORMAT = 1
# What a resume reads from state.json (train_config must hold the seed).
STATE_KEYS = ("optimizer_step", "world_size", "accumulation_steps", "global_batch_size", "model_config",
              "train_config", "data_fingerprint", "nonfinite_guard")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the folder and the file."""


# ---- resume state -------------------------------------------------------------------------------

def _tensors_for_safetensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None):
    # Tied weights share storage, which safetensors refuses; each key gets its own copy.
    return {k: (v.detach().to(dtype) if dtype else v.detach()).cpu().contiguous().clone() for k, v in state_dict.items()}


def save_resume_state(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scaler: torch.amp.GradScaler, state: dict[str, Any], hooks=None) -> Path:
    """Write a complete resume checkpoint of the live model, optimizer and scaler into the (new, empty or
    missing) folder `path` (the training loop writes a snapshot of them instead: `write_resume_state`)."""
    return write_resume_state(path, model_state=model_tensors(model.state_dict()),
                              optimizer_state=optimizer.state_dict(), scaler_state=scaler.state_dict(), state=state,
                              hooks=hooks)


def model_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict as safetensors takes it: on the CPU, each key its own copy."""
    return _tensors_for_safetensors(state_dict)


def write_resume_state(path: str | os.PathLike, *, model_state: dict[str, torch.Tensor], optimizer_state: dict,
                       scaler_state: dict, state: dict[str, Any], hooks=None) -> Path:
    """Write a complete resume checkpoint into the (new, empty or missing) folder `path`: each file hashed as it
    is written (no second read), COMPLETE.json last.

    A write that fails (a full disk, a quota, a lost mount) raises CheckpointError naming the
    optimizer step, the folder and the file; the marker is never written, so `verify` refuses what
    was left and every earlier checkpoint stays as it was. `hooks` (`minilm.testing.FaultHooks`) is
    for the fault tests only.
    """
    path = Path(path)
    step = state.get("optimizer_step")
    state = {"format_version": STATE_FORMAT, **state}
    writers = {
        "model.safetensors": lambda f: write_safetensors(f, model_state),
        "optimizer.pt": lambda f: _torch_save(optimizer_state, f),
        "scaler.pt": lambda f: _torch_save(scaler_state, f),
        "state.json": lambda f: _write_bytes(f, json.dumps(state, indent=2, sort_keys=True).encode()),
    }
    digests = {}
    with _write_errors(path, step) as current:
        path.mkdir(parents=True, exist_ok=True)
        for name, write in writers.items():
            current[0] = name
            if hooks:
                hooks.before_checkpoint_file(step, name)
            digests[name] = write(path / name)
        current[0] = MARKER
        if hooks:
            hooks.before_marker(path, step)
        write_marker(path, RESUME_FILES, digests)
    return path


@contextlib.contextmanager
def _write_errors(path: Path, step: int | None):
    """Turn an I/O error of a checkpoint write into one CheckpointError line; yields [name of the file being written]."""
    current = [path.name]
    try:
        yield current
    except (OSError, SafetensorError) as e:
        raise CheckpointError(write_error(path, step, current[0], e)) from None


class _HashingFile(io.RawIOBase):
    """The file a checkpoint is written through: SHA-256 of the bytes as they go by (COMPLETE.json needs no second
    read), and the OSError of a failed write kept (torch's C++ writer turns ENOSPC into an opaque RuntimeError,
    "unexpected pos ..."), so the caller can raise that instead."""

    def __init__(self, raw):
        self.raw, self.error, self.sha256 = raw, None, hashlib.sha256()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        view = memoryview(b).cast("B")
        done = 0
        try:
            while done < len(view):
                done += self.raw.write(view[done:])
        except OSError as e:
            self.error = e
            raise
        self.sha256.update(view)
        return done


def _torch_save(obj, f: Path) -> str:
    """torch.save into `f`; its SHA-256."""
    with open(f, "wb", buffering=0) as raw:
        out = _HashingFile(raw)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise
        return out.sha256.hexdigest()


def _write_bytes(f: Path, payload: bytes) -> str:
    with open(f, "wb", buffering=0) as raw:
        out = _HashingFile(raw)
        out.write(payload)
        return out.sha256.hexdigest()


# safetensors lays the tensors out by dtype (this order, widest first), then by name.
_SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
                       torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_RANK = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPES.values())}


def write_safetensors(f: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """A safetensors file laid out as `safetensors.torch.save_file` lays it out (without metadata: byte for byte),
    streamed from the tensors' own memory (no serialized copy) and hashed as written; its SHA-256. The tensors
    are CPU tensors; the metadata keys go in sorted order (safetensors' own order is a hash map's)."""
    order = sorted(tensors, key=lambda k: (_DTYPE_RANK[_SAFETENSORS_DTYPES[tensors[k].dtype]], k))
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))} if metadata else {}
    offset = 0
    for k in order:
        t = tensors[k]
        end = offset + t.numel() * t.element_size()
        header[k] = {"dtype": _SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(f, "wb", buffering=0) as raw:
        out = _HashingFile(raw)
        out.write(struct.pack("<Q", len(text)) + text)
        for k in order:
            t = tensors[k]
            if t.numel():
                out.write(t.detach().contiguous().view(-1).view(torch.uint8).numpy())
        return out.sha256.hexdigest()


def is_disk_full(e: BaseException) -> bool:
    """ENOSPC or EDQUOT, also when safetensors or pyarrow (Ray's checkpoint upload) say it only in the message."""
    return getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "no space left on device" in str(e).lower()


def write_error(path: Path | str, step: int | None, name: str, e: BaseException) -> str:
    """One line: which checkpoint could not be written where, why, and what is left intact."""
    why = "no space left on device" if is_disk_full(e) else (getattr(e, "strerror", None) or str(e) or type(e).__name__)
    if step is None:
        return f"could not write {path} ({name}): {why}; free space (or fix the storage) and try again"
    return (f"could not write the checkpoint of optimizer step {step} to {path} ({name}): {why}; earlier "
            f"checkpoints are intact: free space (or fix the storage), then continue with --resume auto")


def write_marker(path: Path, files: tuple[str, ...] | list[str], digests: dict[str, str] | None = None) -> None:
    """COMPLETE.json naming `files` with their SHA-256 (`digests`, taken as they were written; else read here)."""
    marker = {"files": {name: (digests or {}).get(name) or file_sha256(path / name) for name in files}}
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True))
    os.replace(tmp, path / MARKER)  # atomic: the marker appears whole or not at all


def verify(path: str | os.PathLike, once_per_node: bool = False) -> None:
    """Raise CheckpointError unless `path` holds a complete checkpoint whose files match their hashes.

    `once_per_node` (a resume): the files are hashed once per node. The first process to verify the folder
    holds a lock in the node's cache (`minilm.data.cache_root()/verified-checkpoints`) while it hashes and
    then leaves a stamp there (the marker's SHA-256, each file's size, mtime and inode); a process that finds
    a matching stamp (another rank of the node, or the same one loading what it has just picked) trusts it,
    and any change to a file or to the marker makes it hash again."""
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
    with _node_lock(stamps / f"{key}.lock"):
        stamp = {"marker_sha256": hashlib.sha256(raw).hexdigest(), "files": _file_keys(path, files)}
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


def _file_keys(path: Path, files) -> dict[str, list[int]]:
    keys = {}
    for name in files:
        st = (path / name).stat()
        keys[name] = [st.st_size, st.st_mtime_ns, st.st_ino]
    return keys


@contextlib.contextmanager
def _node_lock(lock_path: Path):
    """An exclusive lock between the processes of a node (none where the cache cannot be written)."""
    import fcntl

    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        f = open(lock_path, "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclass
class ResumeState:
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    scaler_state: dict
    state: dict[str, Any]


def load_resume_state(path: str | os.PathLike, map_location: str | torch.device = "cpu",
                      keys: tuple[str, ...] = (), once_per_node: bool = False) -> ResumeState:
    """Verify (`verify`), then load a resume checkpoint. Never unpickles arbitrary objects (weights_only=True).
    `keys`: what state.json must hold (a resume passes STATE_KEYS; an export needs only model_config)."""
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


def checkpoint_dtype(state: dict[str, Any]) -> str | None:
    """The precision a checkpoint's run trained in (None for an old checkpoint that left it at auto)."""
    dtype = state.get("dtype") or state.get("train_config", {}).get("dtype")
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype) if dtype != "auto" else None


# Train-config fields a resume may change without changing the optimisation (logging, checkpoint cadence, speed
# switches that give the same math, how the global batch is split). Every other field, and any field added
# later, changes the schedule or the optimizer: a resume refuses it unless --allow-config-change.
# Train-config fields added after checkpoints were first written, and the value every checkpoint that lacks
# one ran with: a resume continues that value (Trainer.restore), whatever today's default is.
PREDATED_VALUES = {"schedule": "cosine"}

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
    """checkpoint_<step>, or checkpoint_<step>_<k> when a folder of that name is already there (a step
    redone after falling back past a corrupt or unregistered checkpoint must not write into it)."""
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
    """Keep the newest `keep` complete checkpoints (those with a marker, and `newest`, the one just completed) of
    a local run folder; delete the older ones and the incomplete folders older than them. A checkpoint still
    being written is in its staging folder, never a checkpoint folder. A folder that cannot be deleted is logged
    and stays: a failed delete never stops a run. Returns what was removed."""
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

    A failed write (a full disk) raises CheckpointError naming `step` (of the checkpoint it belongs to).

    The model is put in eval mode while its weights are taken and back in train mode after, as the
    MiniMind's loop does (dropout and the MoE aux-loss bookkeeping are train-only; a state dict read in eval
    mode is what inference will see).
    """
    was_training = model.training
    model.eval()
    try:
        state = _tensors_for_safetensors(model.state_dict(), dtype)
    finally:
        model.train(was_training)
    return write_weights_export(path, state, config, tokenizer_path, dtype, step)


def write_weights_export(path: str | os.PathLike, model_state: dict[str, torch.Tensor], config: ModelConfig,
                         tokenizer_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float16,
                         step: int | None = None) -> Path:
    """`export_weights` of a model state (CPU tensors, any float dtype: cast to `dtype` here)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_export(path, tmp, model_state, config, tokenizer_path, dtype, step)
    except CheckpointError:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk gets its space back
        raise
    return path


def _write_export(path: Path, tmp: Path, model_state: dict[str, torch.Tensor], config: ModelConfig,
                  tokenizer_path: str | os.PathLike | None, dtype: torch.dtype, step: int | None) -> None:
    with _write_errors(tmp, step) as current:
        tmp.mkdir(parents=True)
        digests = {}
        current[0] = "model.safetensors"
        digests[current[0]] = write_safetensors(tmp / "model.safetensors",
                                                {k: v.to(dtype) for k, v in model_state.items()},
                                                metadata={"format": "pt", "dtype": str(dtype).removeprefix("torch.")})
        current[0] = "config.json"
        digests[current[0]] = _write_bytes(tmp / "config.json",
                                           json.dumps(config.to_dict(), indent=2, sort_keys=True).encode())
        if tokenizer_path is not None:
            current[0] = "tokenizer.json"
            digests[current[0]] = _write_bytes(tmp / "tokenizer.json", Path(tokenizer_path).read_bytes())
        current[0] = MARKER
        write_marker(tmp, list(digests), digests)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


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
