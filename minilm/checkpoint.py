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

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .data import file_sha256

MARKER = "COMPLETE.json"
RESUME_FILES = ("model.safetensors", "optimizer.pt", "scaler.pt", "state.json")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt; the message names the folder and the file."""


# ---- resume state -------------------------------------------------------------------------------

def _tensors_for_safetensors(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None = None):
    # Tied weights share storage, which safetensors refuses; each key gets its own copy.
    return {k: (v.detach().to(dtype) if dtype else v.detach()).cpu().contiguous().clone() for k, v in state_dict.items()}


def save_resume_state(path: str | os.PathLike, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                      scaler: torch.amp.GradScaler, state: dict[str, Any]) -> Path:
    """Write a complete resume checkpoint into the (new, empty or missing) folder `path`."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_tensors_for_safetensors(model.state_dict()), str(path / "model.safetensors"))
    torch.save(optimizer.state_dict(), path / "optimizer.pt")
    torch.save(scaler.state_dict(), path / "scaler.pt")
    (path / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    _before_marker_hook(path)
    write_marker(path, RESUME_FILES)
    return path


def _before_marker_hook(path: Path) -> None:
    """Test hook: MINILM_TEST_CHECKPOINT_DELAY_S widens the window before the marker (fault tests)."""
    delay = float(os.environ.get("MINILM_TEST_CHECKPOINT_DELAY_S", "0") or 0)
    if delay > 0:
        import time

        time.sleep(delay)


def write_marker(path: Path, files: tuple[str, ...] | list[str]) -> None:
    marker = {"files": {name: file_sha256(path / name) for name in files}}
    tmp = path / (MARKER + ".tmp")
    tmp.write_text(json.dumps(marker, indent=2, sort_keys=True))
    os.replace(tmp, path / MARKER)  # atomic: the marker appears whole or not at all


def verify(path: str | os.PathLike) -> None:
    """Raise CheckpointError unless `path` holds a complete checkpoint whose files match their hashes."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {MARKER} is missing (the write did not finish)")
    try:
        files = json.loads(marker.read_text())["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is unreadable ({e})") from None
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing")
        if file_sha256(f) != digest:
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} does not match its SHA-256 in {MARKER}")


@dataclass
class ResumeState:
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    scaler_state: dict
    state: dict[str, Any]


def load_resume_state(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> ResumeState:
    """Verify, then load a resume checkpoint. Never unpickles arbitrary objects (weights_only=True)."""
    path = Path(path)
    verify(path)
    try:
        return ResumeState(
            model_state=load_file(str(path / "model.safetensors"), device=str(map_location)),
            optimizer_state=torch.load(path / "optimizer.pt", map_location=map_location, weights_only=True),
            scaler_state=torch.load(path / "scaler.pt", map_location="cpu", weights_only=True),
            state=json.loads((path / "state.json").read_text()),
        )
    except Exception as e:  # hashes matched, so this is a format problem, not a torn write
        raise CheckpointError(f"checkpoint {path} could not be loaded: {type(e).__name__}: {e}") from None


def resume_problems(state: dict[str, Any], model_config: ModelConfig, global_batch_size: int, seed: int,
                    data_fingerprint: str) -> list[str]:
    """Why a run with these settings cannot continue from a checkpoint's state.json (empty: it can)."""
    problems = []
    if state["global_batch_size"] != global_batch_size:
        problems.append(f"global_batch_size {global_batch_size} != {state['global_batch_size']} in the checkpoint "
                        f"(the global batch is the invariant of a run)")
    if state["model_config"] != model_config.to_dict():
        changed = sorted(k for k, v in model_config.to_dict().items() if state["model_config"].get(k) != v)
        problems.append(f"the model config differs from the checkpoint's ({', '.join(changed)})")
    if state["data_fingerprint"] != data_fingerprint:
        problems.append(f"the data fingerprint {data_fingerprint[:12]} differs from the checkpoint's "
                        f"{state['data_fingerprint'][:12]} (other --data, or data made with another tokenizer)")
    if state["train_config"]["seed"] != seed:
        problems.append(f"seed {seed} != {state['train_config']['seed']} in the checkpoint")
    return problems


def latest_complete(checkpoint_dirs: list[Path], log=print) -> Path | None:
    """The newest complete checkpoint among `checkpoint_dirs` (sorted oldest first); says what it skips."""
    for p in reversed(checkpoint_dirs):
        try:
            verify(p)
            return p
        except CheckpointError as e:
            log(f"skipping checkpoint: {e}")
    return None


# ---- weight exports -----------------------------------------------------------------------------

def export_weights(path: str | os.PathLike, model: torch.nn.Module, config: ModelConfig,
                   tokenizer_path: str | os.PathLike | None = None, dtype: torch.dtype = torch.float16) -> Path:
    """Half-precision safetensors + config.json (+ tokenizer.json), written to a temp folder and renamed.

    The model is put in eval mode while its weights are taken and back in train mode after, as the
    seed asks (dropout and the MoE aux-loss bookkeeping are train-only; a state dict read in eval
    mode is what inference will see).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    was_training = model.training
    model.eval()
    try:
        save_file(_tensors_for_safetensors(model.state_dict(), dtype), str(tmp / "model.safetensors"),
                  metadata={"format": "pt", "dtype": str(dtype).removeprefix("torch.")})
    finally:
        model.train(was_training)
    (tmp / "config.json").write_text(json.dumps(config.to_dict(), indent=2, sort_keys=True))
    files = ["model.safetensors", "config.json"]
    if tokenizer_path is not None:
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
        files.append("tokenizer.json")
    write_marker(tmp, files)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


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
