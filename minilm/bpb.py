"""Bits per byte, held-out cross-entropy that compares models with different tokenizers fairly:

    bits per byte = (sum of next-token cross-entropy in nats) / ln 2 / (UTF-8 bytes those tokens spell)

A byte-level BPE token spells fixed bytes (`token_byte_lengths`); special tokens spell none and count in neither sum.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator, Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """{the character a byte-level BPE writes for a byte: the byte}. GPT-2's convention (HF ByteLevel): printable
    Latin-1 bytes stand for themselves, the others are shifted to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def token_bytes(token: str) -> bytes:
    """The bytes a byte-level BPE token string stands for (KeyError if it is not byte-level)."""
    return bytes(map(byte_level_alphabet().__getitem__, token))


def token_byte_lengths(tokenizer_json: str | os.PathLike) -> np.ndarray:
    """UTF-8 bytes each token id decodes to (0 for special tokens and gaps), from a byte-level BPE
    `tokenizer.json`; ValueError for another tokenizer, whose tokens have no fixed bytes."""
    path = Path(tokenizer_json)
    spec = json.loads(path.read_text(encoding="utf-8"))
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise ValueError(f"{path}: bits per byte needs a byte-level BPE tokenizer (model BPE, decoder ByteLevel)")
    special = {t["id"] for t in spec.get("added_tokens", [])}
    vocab: dict[str, int] = model["vocab"]
    lengths = np.zeros(max([*vocab.values(), *special]) + 1, dtype=np.int64)
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


def document_windows(ids: Sequence[int], window: int, stride: int) -> list[tuple[list[int], int]]:
    """Sliding windows over one token sequence, [(tokens, first_scored_target), ...]: every target ids[1:] is scored
    once, after the first window with at least `window - stride` earlier tokens of context."""
    if not 0 < stride < window:
        raise ValueError(f"need 0 < stride < window, got stride {stride}, window {window}")
    out: list[tuple[list[int], int]] = []
    scored = start = 0  # targets scored so far; the window's first token
    while scored < len(ids) - 1:
        chunk = list(ids[start:start + window])
        out.append((chunk, scored - start))
        scored = start + len(chunk) - 1
        start += stride
    return out


def padded_batches(pieces: list[tuple[list[int], int]],
                   batch_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of (tokens, first scored target) pieces, right-padded: (inputs, targets), a target -100 where it is
    not scored."""
    for b in range(0, len(pieces), batch_size):
        batch = pieces[b:b + batch_size]
        width = max(len(t) for t, _ in batch) - 1
        inputs = torch.zeros(len(batch), width, dtype=torch.long)
        targets = torch.full((len(batch), width), -100, dtype=torch.long)
        for r, (toks, first) in enumerate(batch):
            row = torch.as_tensor(toks)
            inputs[r, :len(toks) - 1] = row[:-1]
            targets[r, first:len(toks) - 1] = row[first + 1:]
        yield inputs, targets


@torch.no_grad()
def evaluate_documents(model: torch.nn.Module, documents: Sequence[Sequence[int]], byte_lengths: np.ndarray, *,
                       prefix: Sequence[int], window: int, stride: int | None = None, batch_size: int = 16,
                       device: str | torch.device = "cpu") -> dict:
    """{"bpb", "nats", "bytes", "tokens", "windows"} of `documents` (token ids; special tokens are not scored), each
    read as `prefix` (the training format's document start) + document, in right-padded windows, in fp32."""
    stride = stride or window // 2
    pieces = [piece for doc in documents for piece in document_windows([*prefix, *doc], window, stride)]
    lengths = torch.as_tensor(byte_lengths, dtype=torch.long)
    was_training = model.training
    model.eval()
    nats = torch.zeros((), dtype=torch.float64)
    num_bytes = tokens = 0
    for inputs, targets in padded_batches(pieces, batch_size):
        nbytes = lengths[targets.clamp(min=0)] * (targets >= 0)
        weights = (nbytes > 0).float()
        inputs, targets = inputs.to(device), targets.to(device)
        with torch.autocast(inputs.device.type, enabled=False):  # the head chunk by chunk, fp32 nats
            nats += (model(inputs, targets=targets, reduction="none").loss * weights.to(device)).sum().double().cpu()
        num_bytes += int(nbytes.sum())
        tokens += int(weights.sum())
    model.train(was_training)
    return {"bpb": bits_per_byte(float(nats), num_bytes), "nats": float(nats), "bytes": num_bytes,
            "tokens": tokens, "windows": len(pieces)}
