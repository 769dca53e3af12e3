"""Bits per byte, held-out cross-entropy that compares models with different tokenizers fairly:

    bits per byte = (sum of next-token cross-entropy in nats) / ln 2 / (UTF-8 bytes those tokens spell)

A byte-level BPE token spells fixed bytes (`token_byte_lengths`); special tokens spell none and count in neither sum.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """{the character a byte-level BPE writes for a byte: the byte}. GPT-2's convention (HF ByteLevel): printable
    Latin-1 bytes stand for themselves, the others are shifted to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char_to_byte = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            char_to_byte[chr(256 + shifted)] = b
            shifted += 1
    return char_to_byte


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token string stands for (KeyError if it is not byte-level)."""
    alphabet = byte_level_alphabet()
    return bytes(alphabet[c] for c in token)


def token_byte_lengths(tokenizer_json: str | os.PathLike) -> np.ndarray:
    """UTF-8 bytes each token id decodes to (0 for special tokens and gaps), from a byte-level BPE
    `tokenizer.json` or its folder; ValueError for another tokenizer, whose tokens have no fixed bytes."""
    path = Path(tokenizer_json)
    if path.is_dir():
        path = path / "tokenizer.json"
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{path}: bits per byte needs a byte-level BPE tokenizer (model BPE, decoder ByteLevel)")
    special = {t["id"] for t in spec.get("added_tokens", [])}
    vocab: dict[str, int] = model["vocab"]
    size = max([*vocab.values(), *special]) + 1
    lengths = np.zeros(size, dtype=np.int64)
    for tok, i in vocab.items():
        if i in special:
            continue
        try:
            lengths[i] = len(token_bytes(tok))
        except KeyError:
            raise ValueError(f"{path}: token {tok!r} (id {i}) is not in the byte-level alphabet") from None
    return lengths


def bits_per_byte(nats: float, num_bytes: int) -> float:
    """Sum of cross-entropy in nats over the scored tokens -> bits per UTF-8 byte of their text."""
    if num_bytes <= 0:
        raise ValueError(f"bits per byte of {num_bytes} bytes is undefined")
    return float(nats) / math.log(2) / num_bytes


def _targets_nats(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor,
                  autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """Sum over positions of CE(logits at t, targets[t]) x weights[t] (weights are 0 or 1), in fp32."""
    ctx = (torch.autocast(inputs.device.type, dtype=autocast_dtype) if autocast_dtype not in (None, torch.float32)
           else torch.autocast(inputs.device.type, enabled=False))
    with ctx:
        nats = model(inputs, targets=targets, reduction="none").loss  # the head chunk by chunk, fp32 nats
    return (nats * weights).sum()


@torch.no_grad()
def score_rows(model: torch.nn.Module, rows: torch.Tensor, byte_lengths: torch.Tensor, *,
               autocast_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(nats, bytes) summed over the text targets of `rows` (n, seq_len + 1), on the device (no host sync), by the
    model as it is (call `model.eval()` first)."""
    byte_lengths = byte_lengths.to(rows.device)
    targets = rows[:, 1:]
    nbytes = byte_lengths[targets]
    nats = _targets_nats(model, rows[:, :-1], targets, (nbytes > 0).float(), autocast_dtype)
    return nats, nbytes.sum()


def document_windows(ids: Sequence[int], window: int, stride: int) -> list[tuple[list[int], int]]:
    """Sliding windows over one token sequence, [(tokens, first_scored_target), ...]: every target ids[1:] is scored
    once, after the first window with at least `window - stride` earlier tokens of context."""
    if not 0 < stride < window:
        raise ValueError(f"need 0 < stride < window, got stride {stride}, window {window}")
    out: list[tuple[list[int], int]] = []
    n_targets = len(ids) - 1
    scored = 0  # targets scored so far
    start = 0
    while scored < n_targets:
        chunk = list(ids[start:start + window])
        out.append((chunk, scored - start))
        scored = start + len(chunk) - 1
        start += stride
    return out


@torch.no_grad()
def evaluate_documents(model: torch.nn.Module, documents: Sequence[Sequence[int]], byte_lengths: np.ndarray, *,
                       prefix: Sequence[int], window: int, stride: int | None = None, batch_size: int = 16,
                       device: str | torch.device = "cpu", autocast_dtype: torch.dtype | None = None) -> dict:
    """{"bpb", "nats", "bytes", "tokens", "windows"} of `documents` (token ids, no special tokens), each read as
    `prefix` (the training format's document start) + document, in right-padded windows."""
    stride = stride or window // 2
    pieces: list[tuple[list[int], int]] = []
    for doc in documents:
        pieces.extend(document_windows([*prefix, *doc], window, stride))
    lengths = torch.as_tensor(byte_lengths, dtype=torch.long)
    was_training = model.training
    model.eval()
    nats = torch.zeros((), dtype=torch.float64)
    num_bytes = tokens = 0
    for b in range(0, len(pieces), batch_size):
        batch = pieces[b:b + batch_size]
        width = max(len(t) for t, _ in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        scored = torch.zeros(len(batch), width - 1, dtype=torch.bool)
        for i, (toks, first) in enumerate(batch):
            ids[i, :len(toks)] = torch.as_tensor(toks)
            scored[i, first:len(toks) - 1] = True
        targets = ids[:, 1:]
        nbytes = lengths[targets] * scored
        weights = (nbytes > 0).float()
        ids, targets, weights = ids.to(device), targets.to(device), weights.to(device)
        nats += _targets_nats(model, ids[:, :-1], targets, weights, autocast_dtype).double().cpu()
        num_bytes += int(nbytes.sum())
        tokens += int(weights.sum())
    model.train(was_training)
    return {"bpb": bits_per_byte(float(nats), num_bytes), "nats": float(nats), "bytes": num_bytes,
            "tokens": tokens, "windows": len(pieces)}
