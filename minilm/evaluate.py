"""Evaluation beyond loss, away from the training path: `evaluate_checkpoint(path, tasks)` is the whole job of one
checkpoint, plain arguments in and plain records out, so it runs in-process or as a Ray task."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import checkpoint as C
from .bpb import evaluate_documents, padded_batches, token_byte_lengths
from .config import TrainConfig
from .model import MiniMindForCausalLM
from .tasks import ChoiceItem, Task, TaskError
from .tokenizer import BOS_ID, EOS_ID

# ---- scoring ----------------------------------------------------------------------------------------

@torch.no_grad()
def choice_loglikelihoods(model: torch.nn.Module, tokenizer, items: list[ChoiceItem], *, prefix: str = "",
                          max_len: int | None = None, batch_size: int = 16,
                          device: str | torch.device = "cpu") -> list[list[float]]:
    """For each item, the log-likelihood (nats) of each choice's tokens given [BOS] + prefix + context, the context
    cut from the left to fit `max_len` tokens (right-padded: positions outside the choice have no target, -100)."""
    max_len = max_len or model.config.max_position_embeddings
    pieces = []  # (ids, the first scored target): one per (item, choice), in order
    for i, item in enumerate(items):
        context = tokenizer.encode(prefix + item.context).ids
        for choice in item.choices:
            cont = tokenizer.encode(choice).ids
            room = max_len - 1 - len(cont)  # context tokens that fit after BOS: the choice is what is scored, whole
            if room < 0:
                raise TaskError(f"item {i + 1}: a choice of {len(cont)} tokens does not fit the window of {max_len} "
                                f"({choice[:40]!r})")
            kept = context[max(0, len(context) - room):]
            pieces.append(([BOS_ID, *kept, *cont], len(kept)))
    sums = []
    for inputs, targets in padded_batches(pieces, batch_size):
        nats = model(inputs.to(device), targets=targets.to(device), reduction="none").loss
        sums += (-nats.double().sum(1)).tolist()
    values = iter(sums)
    return [[next(values) for _ in item.choices] for item in items]


def choice_metrics(items: list[ChoiceItem], loglik: list[list[float]]) -> dict[str, float]:
    """`acc`: the most likely choice is right; `acc_norm`: the most likely per UTF-8 byte (not penalising length)."""
    acc = acc_norm = 0
    for item, ll in zip(items, loglik, strict=True):
        per_byte = [v / max(1, len(c.encode("utf-8"))) for v, c in zip(ll, item.choices, strict=True)]
        acc += max(range(len(ll)), key=ll.__getitem__) == item.label
        acc_norm += max(range(len(ll)), key=per_byte.__getitem__) == item.label
    return {"acc": acc / len(items), "acc_norm": acc_norm / len(items)}


def fewshot_prefix(examples: list[ChoiceItem]) -> str:
    """Each few-shot example solved (its context and its right answer), then a blank line."""
    return "".join(e.context + e.choices[e.label] + "\n\n" for e in examples)


# ---- a checkpoint --------------------------------------------------------------------------------------

@dataclass
class Checkpoint:
    """What a record names a checkpoint by (`step` None: a weights export outside a checkpoint)."""
    path: Path
    step: int | None
    weights_sha256: str
    resume: bool  # a resume checkpoint (state.json), else a weights export


def identify(path: str | os.PathLike) -> Checkpoint:
    """A checkpoint's identity from its marker and state.json, read without loading it (CheckpointError if it is
    not a checkpoint or export folder); `verify` still runs before it is loaded."""
    path = Path(path)
    if not path.is_dir():
        raise C.CheckpointError(f"checkpoint {path} does not exist")
    raw = (path / C.MARKER).read_bytes() if (path / C.MARKER).is_file() else None
    files = C.files.parse_marker(raw, path)
    if "state.json" in files:
        step = C.read_state(path, ("optimizer_step",))["optimizer_step"]
        if not isinstance(step, int) or isinstance(step, bool):
            raise C.CheckpointError(f"checkpoint {path}: state.json's optimizer_step is {step!r}, not a step")
        return Checkpoint(path, step, files["model.safetensors"], True)
    if "config.json" not in files:
        raise C.CheckpointError(f"{path} is neither a resume checkpoint (state.json) nor a weights export "
                                f"(config.json)")
    parent = path.parent / "state.json"  # a checkpoint's own weights/ export: the step is its checkpoint's
    step = C.read_state(path.parent, ("optimizer_step",))["optimizer_step"] if parent.is_file() else None
    return Checkpoint(path, step, files["model.safetensors"], False)


def find_tokenizer(checkpoint: Checkpoint, given: str | os.PathLike | None) -> Path:
    """--tokenizer, else the checkpoint's own tokenizer.json (in its weights/ export, or the export's), else that of
    another checkpoint of its run folder (with --export-every N only every N-th has one; a run keeps its tokenizer)."""
    if given:
        return Path(given)
    own = [checkpoint.path / "weights" / "tokenizer.json", checkpoint.path / "tokenizer.json"]
    run = sorted(checkpoint.path.parent.glob("checkpoint_*/weights/tokenizer.json"), reverse=True)
    for candidate in [*own, *(run if checkpoint.resume else [])]:
        if candidate.is_file():
            return candidate
    raise TaskError(f"{checkpoint.path} has no tokenizer.json, nor has its weights/ or another checkpoint of its "
                    f"run: give --tokenizer, the tokenizer.json of the data the model was trained on")


def evaluate_checkpoint(path: str | os.PathLike, tasks: list[Task], *, tokenizer: str | os.PathLike | None = None,
                        device: str | torch.device = "cpu") -> list[dict]:
    """Every task on one checkpoint (a resume checkpoint folder or a weights export): one record each."""
    checkpoint = identify(path)
    tokenizer_path = find_tokenizer(checkpoint, tokenizer)
    model, state = C.open_weights(checkpoint.path, device)
    tok = C.open_tokenizer(tokenizer_path, model.config, (state or {}).get("tokenizer_sha256"))
    seq_len = ((state or {}).get("train_config") or {}).get("seq_len") or TrainConfig().seq_len
    records = []
    for task in tasks:
        start = time.perf_counter()
        result = run_task(task, model, tok, tokenizer_path, seq_len + 1, device)
        records.append({"task": task.name, "kind": task.kind, "fingerprint": task.fingerprint,
                        "file": str(task.path), "file_sha256": task.file_sha256, "checkpoint": str(checkpoint.path),
                        "step": checkpoint.step, "weights_sha256": checkpoint.weights_sha256, **result,
                        "seconds": round(time.perf_counter() - start, 3),
                        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return records


def run_task(task: Task, model: MiniMindForCausalLM, tokenizer, tokenizer_path: Path, window: int,
             device: str | torch.device) -> dict:
    """{"metrics": {...}, "items": n} (+ "generations" for a generate task)."""
    opts = task.options
    if task.kind in ("hellaswag", "choice"):
        try:
            loglik = choice_loglikelihoods(model, tokenizer, task.items, prefix=fewshot_prefix(task.fewshot),
                                           max_len=window, batch_size=opts["batch_size"], device=device)
        except TaskError as e:
            raise TaskError(f"task {task.name!r} ({task.path}): {e}") from None
        return {"metrics": choice_metrics(task.items, loglik), "items": len(task.items)}
    if task.kind == "bpb":
        try:
            lengths = token_byte_lengths(tokenizer_path)
        except ValueError as e:
            raise TaskError(f"task {task.name!r}: {e}") from None
        docs = [tokenizer.encode(text).ids for text in task.items]
        window = min(opts["window"] or window, model.config.max_position_embeddings)
        if opts["stride"] is not None and not opts["stride"] < window:
            raise TaskError(f"task {task.name!r}: stride {opts['stride']} must be less than the window {window}")
        r = evaluate_documents(model, docs, lengths, prefix=[BOS_ID], window=window, stride=opts["stride"],
                               batch_size=opts["batch_size"], device=device)
        return {"metrics": {"bpb": r["bpb"], "nats_per_token": r["nats"] / max(1, r["tokens"])},
                "items": len(docs), "bytes": r["bytes"], "tokens": r["tokens"]}
    texts = []
    for prompt in task.items:  # continued greedily from [BOS] + prompt until EOS or max_new_tokens: the text added
        ids = [BOS_ID, *tokenizer.encode(prompt).ids]
        out = model.generate(torch.tensor([ids], device=device), max_new_tokens=opts["max_new_tokens"], temperature=0,
                             eos_token_id=EOS_ID)[0, len(ids):].tolist()
        texts.append(tokenizer.decode([t for t in out if t != EOS_ID]))
    return {"metrics": {"prompts": len(texts)}, "items": len(texts),
            "generations": [{"prompt": p, "text": t} for p, t in zip(task.items, texts, strict=True)]}


def format_scores(record: dict) -> str:
    """A record's metrics, and for generations the first one, cut to fit a line (all of them are in the record)."""
    text = "  ".join(f"{k} {v:.4f}" if isinstance(v, float) and not math.isnan(v) else f"{k} {v}"
                     for k, v in record["metrics"].items())
    if record.get("generations"):
        first = record["generations"][0]
        text += f"  {first['prompt'][:30]!r} -> {first['text'][:60]!r}"
    return text
