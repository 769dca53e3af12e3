"""A checkpoint or export folder on disk: each file hashed as it is written and fsynced, COMPLETE.json last
(the files of each: docs/reliability.md)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from .. import fsio
from ..config import ModelConfig
from ..data import cache_root, file_sha256
from ..safety import check_name
from ..step import TORCH_DTYPES

MARKER = "COMPLETE.json"
RESUME_FILES = ("model.safetensors", "optimizer.pt", "scaler.pt", "state.json")
EXPORT_KINDS = ("weights", "hf", "gguf", "demo-tasks")  # a marker's "kind" that `write_export` may replace
# state.json's format: a change an older reader would misread bumps it (and adds a fixture under tests/fixtures/).
STATE_FORMAT = 1
# What a resume reads from state.json (train_config must hold the seed).
STATE_KEYS = ("optimizer_step", "world_size", "accumulation_steps", "global_batch_size", "model_config",
              "train_config", "data_fingerprint", "nonfinite_guard")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be written; the message names the folder and file."""


@dataclass
class ResumeState:
    """What a checkpoint holds: loaded (`load_resume_state`), or a snapshot of the live state to be written."""

    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    scaler_state: dict
    state: dict[str, Any] = field(default_factory=dict)  # state.json's content
    event: Any = None  # a snapshot on CUDA: its copies are complete once this event is


# ---- writing -------------------------------------------------------------------------------------

def write_folder(path: Path, writers: dict[str, Callable[[Path], str]], step: int | None, hooks=None,
                 kind: str = "checkpoint", shown: Path | None = None) -> Path:
    """Write each file of the new folder `path` (a writer returns its SHA-256), then COMPLETE.json naming them with
    their hashes, then the folder fsynced: once the marker exists, so do the bytes it vouches for. A failed write is
    one CheckpointError line naming the step, the folder (`shown`, if staged elsewhere) and the file, and no marker."""
    name = path.name
    try:
        path.mkdir(mode=0o750, parents=True)  # a new folder: never one (or a link) that was there before
        digests = {}
        for name, write in writers.items():
            if hooks:
                hooks.before_checkpoint_file(step, name)
            digests[name] = write(path / name)
        name = MARKER
        if hooks:
            hooks.before_marker(path, step)
        marker = json.dumps({"kind": kind, "files": digests}, indent=2, sort_keys=True)
        fsio.write_atomic(path / MARKER, marker, mode=0o640)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(write_error(shown or path, step, name, e)) from None
    return path


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


class _HashingFile(io.RawIOBase):
    """A file that hashes the bytes written through it and keeps the OSError of a failed write (torch's C++ writer
    turns ENOSPC into an opaque RuntimeError, so the caller raises the kept error instead)."""

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


def _write(f: Path, fill: Callable[[_HashingFile], None]) -> str:
    """Create `f` as a new file (owner and group may read it), `fill` it, fsync it; its SHA-256."""
    with fsio.create(f, 0o640, buffering=0) as raw:
        out = _HashingFile(raw)
        try:
            fill(out)
        except RuntimeError:
            if out.error is not None:
                raise out.error from None
            raise
        os.fsync(raw.fileno())
        return out.sha256.hexdigest()


def torch_save(obj, f: Path) -> str:
    return _write(f, lambda out: torch.save(obj, out))


def write_bytes(f: Path, payload: bytes) -> str:
    return _write(f, lambda out: out.write(payload))


# safetensors lays the tensors out by dtype (this order, widest first), then by name.
_SAFETENSORS_DTYPES = {torch.int64: "I64", torch.float64: "F64", torch.float32: "F32", torch.int32: "I32",
                       torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPE_RANK = {name: rank for rank, name in enumerate(_SAFETENSORS_DTYPES.values())}


def write_safetensors(f: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """The file `safetensors.torch.save_file` writes, streamed from the CPU tensors' own memory; its SHA-256.
    Without metadata it is the same byte for byte; metadata keys go in sorted order (safetensors' is a hash map's)."""
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

    def fill(out: _HashingFile) -> None:
        out.write(struct.pack("<Q", len(text)) + text)
        for k in order:
            if tensors[k].numel():
                out.write(tensors[k].detach().contiguous().view(-1).view(torch.uint8).numpy())

    return _write(f, fill)


def model_tensors(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's state dict as safetensors takes it: on the CPU, each key its own copy (tied weights share
    storage, which safetensors refuses)."""
    return {k: v.detach().cpu().contiguous().clone() for k, v in state_dict.items()}


def write_resume_state(path: str | os.PathLike, snap: ResumeState, hooks=None) -> Path:
    """A complete resume checkpoint of `snap` in the (new, empty or missing) folder `path`; a failed write leaves
    no marker."""
    state = {"format_version": STATE_FORMAT, **snap.state}
    return write_folder(Path(path), {
        "model.safetensors": lambda f: write_safetensors(f, snap.model_state),
        "optimizer.pt": lambda f: torch_save(snap.optimizer_state, f),
        "scaler.pt": lambda f: torch_save(snap.scaler_state, f),
        "state.json": lambda f: write_bytes(f, json.dumps(state, indent=2, sort_keys=True).encode()),
    }, state.get("optimizer_step"), hooks)


# ---- reading ---------------------------------------------------------------------------------------

def parse_marker(raw: bytes | None, where: Path | str, weights: bool = True) -> dict[str, str]:
    """The files a marker vouches for; CheckpointError unless it maps file names to hashes and names the weights
    (unless `weights` is False), so a hand-edited or foreign marker is "not complete", never taken."""
    if raw is None:
        raise CheckpointError(f"checkpoint {where} is incomplete: {MARKER} is missing (the write did not finish)")
    try:
        files = fsio.loads(raw)["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {where}: {MARKER} is unreadable ({type(e).__name__}: {str(e)[:80]})") from None
    if not (isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
            and ("model.safetensors" in files or not weights)):
        raise CheckpointError(f"checkpoint {where}: {MARKER} does not list its files with their hashes and the "
                              f"weights (edited, or not written by minilm)")
    for name in files:  # the one rule for names that become paths
        check_name(name, f"checkpoint {where}: {MARKER} names", CheckpointError)
    return files


def verify(path: str | os.PathLike, once_per_node: bool = False) -> None:
    """Raise CheckpointError unless `path` holds a complete checkpoint whose files match their hashes. `once_per_node`
    (a resume): the node's first process hashes, and leaves a stamp (`fsio.NodeStamp`) the other ranks trust."""
    path = Path(path)
    try:
        found = path.is_dir()
    except OSError as e:  # a name too long, a folder not to be entered
        raise CheckpointError(f"checkpoint {path} cannot be read ({e.strerror or e})") from None
    if not found:
        raise CheckpointError(f"checkpoint {path} does not exist")
    try:
        raw = (path / MARKER).read_bytes() if (path / MARKER).exists() else None
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: {MARKER} cannot be read ({e.strerror or e})") from None
    files = parse_marker(raw, path)
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
    stamp = fsio.NodeStamp(cache_root() / "verified-checkpoints", path, hashlib.sha256(raw).hexdigest()) \
        if once_per_node else None
    with stamp or contextlib.nullcontext():
        for name, digest in files.items():
            if (stamp is None or stamp.known(name) != [digest]) and file_sha256(path / name) != digest:
                raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its SHA-256 in {MARKER}")
            if stamp is not None:
                stamp.vouch(name, digest)


def load_resume_state(path: str | os.PathLike, keys: tuple[str, ...] = (), once_per_node: bool = False) -> ResumeState:
    """`verify`, then load (weights_only: never arbitrary objects); `keys`: what state.json must hold."""
    path = Path(path)
    verify(path, once_per_node)
    try:
        return ResumeState(
            model_state=load_file(str(path / "model.safetensors")),
            optimizer_state=torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True),
            scaler_state=torch.load(path / "scaler.pt", map_location="cpu", weights_only=True),
            state=read_state(path, keys),
        )
    except CheckpointError:
        raise
    except Exception as e:  # hashes matched, so this is a format problem, not a torn write
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(e).__name__}: {e}") from None


def read_state(path: str | os.PathLike, keys: tuple[str, ...] = STATE_KEYS) -> dict[str, Any]:
    try:
        raw = (Path(path) / "state.json").read_bytes()
    except OSError as e:
        raise CheckpointError(f"checkpoint {path}: state.json is unreadable ({e.strerror or e})") from None
    return parse_state(raw, path, keys)


def parse_state(raw: bytes, where, keys: tuple[str, ...] = STATE_KEYS) -> dict[str, Any]:
    """A checkpoint's state.json in today's spelling; one CheckpointError line when this version cannot use it."""
    try:
        state = fsio.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {where}: state.json is unreadable ({e})") from None
    if not isinstance(state, dict) or not isinstance(state.get("train_config", {}), dict):
        raise CheckpointError(f"checkpoint {where}: state.json is not a mapping of minilm's fields")
    version = state.get("format_version", 1)
    if not isinstance(version, int) or version > STATE_FORMAT or version < 1:
        raise CheckpointError(f"checkpoint {where} has state.json format {version!r}, and this version of minilm "
                              f"reads formats 1 to {STATE_FORMAT}: resume it with the minilm that wrote it (or a "
                              f"newer one)")
    missing = [k for k in keys if k not in state]
    if "train_config" in keys and "train_config" in state and "seed" not in state["train_config"]:
        missing.append("train_config.seed")
    if missing:
        raise CheckpointError(f"checkpoint {where}: state.json lacks {', '.join(missing)} (format {version}): "
                              f"it was not written by minilm, or was edited; resume another checkpoint")
    train = state.setdefault("train_config", {})
    if "val_samples" in state:  # written beside train_config before it moved in
        train.setdefault("val_samples", state["val_samples"])
    if train.get("dtype") in (None, "auto") and state.get("dtype"):  # torch's spelling, before the flag's
        train["dtype"] = next((k for k, v in TORCH_DTYPES.items() if str(v) == f"torch.{state['dtype']}"), None)
    return state


# ---- exports ---------------------------------------------------------------------------------------

def check_output(path: Path) -> bool:
    """May an export be written to `path`? True: it holds exactly an earlier minilm export, to be replaced; False: it
    is missing or empty. Anything else is refused with one CheckpointError line, the folder untouched."""
    entries = {p.name for p in path.iterdir()} if path.is_dir() else set()
    if not entries and not path.is_file():
        return False
    try:
        raw = (path / MARKER).read_bytes()
        kind = fsio.loads(raw).get("kind")
        files = parse_marker(raw, path, weights=kind not in ("demo-tasks", "gguf"))
        # an export of an earlier minilm has no kind: weights beside a config, no resume state
        ours = (kind in EXPORT_KINDS or kind is None and "config.json" in files and "state.json" not in files) \
            and entries == {MARKER, *files}
    except (OSError, CheckpointError, ValueError, AttributeError):  # AttributeError: a marker that is no mapping
        ours = False
    if not ours:
        entries = entries or {path.name}
        raise CheckpointError(f"--output {path} holds other files ({', '.join(sorted(entries)[:3])}"
                              f"{', ...' if len(entries) > 3 else ''}): an export writes only into a new or empty "
                              f"folder, or over an earlier minilm export; choose another folder")
    return True


def write_export(path: Path, writers: dict[str, Callable[[Path], str]], kind: str, step: int | None = None) -> Path:
    """Write an export folder beside `path` and rename it into place, replacing only an earlier export of minilm."""
    replace = check_output(path)
    with fsio.staged(path) as staged:
        write_folder(staged, writers, step, kind=kind, shown=path)
        fsio.publish(staged, path, replace)
    return path


def export_weights(path: str | os.PathLike, model: torch.nn.Module, config: ModelConfig,
                   tokenizer_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float16,
                   step: int | None = None, minimind_pth: bool = False) -> Path:
    """`write_weights_export` of a model, taken in eval mode as MiniMind's loop does (what inference sees)."""
    was_training = model.training
    model.eval()
    try:
        state = model_tensors(model.state_dict())
    finally:
        model.train(was_training)
    return write_weights_export(path, state, config, tokenizer_path, dtype, step, minimind_pth=minimind_pth)


def write_weights_export(path: str | os.PathLike, model_state: dict[str, torch.Tensor], config: ModelConfig,
                         tokenizer_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float16,
                         step: int | None = None, *, in_place: bool = False, minimind_pth: bool = False) -> Path:
    """Safetensors in `dtype` + config.json (+ tokenizer.json, + MiniMind's `pretrain_<hidden>[_moe].pth` in fp16) of
    a `model_tensors` state. `in_place`: into a checkpoint's own (new) `weights/` folder, needing no staging."""
    metadata = {"format": "pt", "dtype": str(dtype).removeprefix("torch.")}
    model_state = {k: v.to(dtype) for k, v in model_state.items()}
    writers = {
        "model.safetensors": lambda f: write_safetensors(f, model_state, metadata),
        "config.json": lambda f: write_bytes(f, json.dumps(config.to_dict(), indent=2, sort_keys=True).encode()),
    }
    if tokenizer_path is not None:
        writers["tokenizer.json"] = lambda f: write_bytes(f, Path(tokenizer_path).read_bytes())
    if minimind_pth:
        writers[f"pretrain_{config.hidden_size}{'_moe' if config.use_moe else ''}.pth"] = \
            lambda f: torch_save({k: v.half() for k, v in model_state.items()}, f)
    return write_folder(Path(path), writers, step, kind="weights") if in_place else \
        write_export(Path(path), writers, "weights", step)


def open_weights(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """(model in eval mode, state.json or None) of a verified resume checkpoint or weights export, in fp32 on
    `device`; its config and the weights' shapes are checked before the model is allocated."""
    from ..model import MiniMindForCausalLM

    path = Path(path)
    verify(path)
    what = "checkpoint" if (path / "state.json").is_file() else "weights"
    state = read_state(path, ("optimizer_step", "model_config")) if what == "checkpoint" else None
    try:
        raw = state["model_config"] if state else fsio.loads((path / "config.json").read_text())
        if not isinstance(raw, dict):
            raise CheckpointError(f"{what} {path}: its model_config is a {type(raw).__name__}, not a mapping of fields")
        config = ModelConfig.from_dict(raw).validate()
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            found = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (not a dict)
        # Built to one layer past the weights' last: a config of thousands of layers is refused as fast as any
        indices = [k.split(".")[2] for k in found if k.startswith("model.layers.")]
        layers = 1 + max((int(i) for i in indices if i.isdigit()), default=-1)
        shapes = replace(config, num_hidden_layers=min(config.num_hidden_layers, layers + 1))
        with torch.device("meta"):  # the shapes this config makes, nothing allocated
            expected = {k: list(v.shape) for k, v in MiniMindForCausalLM(shapes).state_dict().items()}
        wrong = next((k for k in sorted(expected.keys() | found.keys()) if found.get(k) != expected.get(k)), None)
        if wrong is not None:
            raise CheckpointError(f"{what} {path}: its weights do not match its model_config: {wrong} is "
                                  f"{found.get(wrong, 'missing')}, the config makes it {expected.get(wrong, 'absent')}")
        model = MiniMindForCausalLM(config)
        model.load_state_dict(load_file(str(path / "model.safetensors")), strict=True)
    except CheckpointError:
        raise
    except Exception as e:
        why = " ".join(str(e).split())[:200]  # one line, whatever the error's own layout
        raise CheckpointError(f"{what} {path} could not be loaded: {type(e).__name__}: {why}") from None
    return model.to(device).eval(), state


def open_tokenizer(path: Path, config: ModelConfig, trained_sha256: str | None = None):
    """The tokenizer at `path`, refused (one TokenizerError line) when it cannot be the model's: more ids than it
    embeds, or not the file its data was prepared with (`trained_sha256`, which state.json keeps)."""
    from ..tokenizer import TokenizerError, load_tokenizer, vocab_size_of

    tokenizer = load_tokenizer(path)
    if vocab_size_of(tokenizer) > config.vocab_size:
        raise TokenizerError(f"{path} has {vocab_size_of(tokenizer)} tokens but the model embeds only "
                             f"vocab_size={config.vocab_size}: not the tokenizer this model was trained with")
    if trained_sha256 and file_sha256(path) != trained_sha256:
        raise TokenizerError(f"{path} is not the tokenizer this checkpoint's data was prepared with (SHA-256 "
                             f"{file_sha256(path)[:12]}, state.json has {trained_sha256[:12]})")
    return tokenizer


def load_pretrained(path: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """(model in eval mode, tokenizer or None) from a weights export folder."""
    from tokenizers import Tokenizer

    model, _ = open_weights(path, device)
    tokenizer = Path(path) / "tokenizer.json"
    return model.to(dtype=dtype), Tokenizer.from_file(str(tokenizer)) if tokenizer.is_file() else None


__all__ = ["MARKER", "RESUME_FILES", "STATE_FORMAT", "STATE_KEYS", "CheckpointError", "ResumeState", "check_output",
           "export_weights", "file_sha256", "is_disk_full", "load_pretrained", "load_resume_state", "model_tensors",
           "open_tokenizer", "open_weights", "read_state", "verify", "write_bytes", "write_error", "write_export",
           "write_resume_state", "write_safetensors", "write_weights_export"]
