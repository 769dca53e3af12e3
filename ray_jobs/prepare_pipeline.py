"""The Ray side of `ray_jobs.prepare`: blocks of records, a plain Ray task each (an ordered map needs none of Ray
Data's planning), taken back in order. Imports stay stdlib only: Ray workers import this module."""

from __future__ import annotations

import logging
import os
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import suppress
from itertools import chain

from .prepare_inputs import RecordReader

# A block is enough work on one core that Ray's per-task cost stays small beside it.
BLOCK_BYTES = 256 << 10
BLOCK_DOCS = 4096
WINDOW_PER_CPU = 2  # tasks in flight per CPU: one running, one queued behind it
MAX_WINDOW = 512


def _si(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}"


class Progress:
    """A tqdm bar of the input bytes done on a terminal; only the messages otherwise."""

    def __init__(self, stream=None, interval: float = 0.5):
        self.stream = stream or sys.stderr
        self.live = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval  # seconds between redraws
        self._bar = None

    def begin(self, total_bytes: int, status: str) -> None:
        from tqdm import tqdm

        self.done()
        self._bar = tqdm(total=total_bytes, desc=status, unit="B", unit_scale=True, unit_divisor=1000,
                         file=self.stream, disable=not self.live, leave=False, dynamic_ncols=True,
                         mininterval=self.interval, miniters=1, smoothing=0.1)

    def restart(self, status: str) -> None:
        """A new phase: the bar shows `status` and counts its rate from now."""
        if self._bar is not None:
            self._bar.set_description_str(status, refresh=False)
            self._bar.reset()

    def update(self, input_bytes: float, docs: int, tokens: int) -> None:
        if self._bar is not None and not self._bar.disable:
            self._bar.set_postfix_str(f"{docs:,} docs, {_si(tokens)} tokens", refresh=False)
            self._bar.update(int(input_bytes) - self._bar.n)

    def message(self, text: str) -> None:
        if self._bar is not None and not self._bar.disable:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    def done(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


_TOKENIZER_CACHE: dict[str, object] = {}


def _encode_block(texts: list[str], tokenizer_json: str, tokenizer_sha256: str, eos_id: int):
    """Ray task: texts -> their token ids as one int32 array, with EOS after every document."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # one Ray CPU per task: no extra threads
    import numpy as np

    tok = _TOKENIZER_CACHE.get(tokenizer_sha256)
    if tok is None:  # once per worker process
        from tokenizers import Tokenizer

        tok = _TOKENIZER_CACHE[tokenizer_sha256] = Tokenizer.from_str(tokenizer_json)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)  # _fast (no offsets) since tokenizers 0.20
    return np.fromiter(chain.from_iterable(e.ids + [eos_id] for e in encode(texts, add_special_tokens=False)),
                       dtype=np.int32)


def start_ray(num_cpus: int | None, warn: Callable[[str], None] = lambda m: None) -> bool:
    """Use the running Ray, or RAY_ADDRESS's, or start a local one; True when this call started it."""
    import ray

    if ray.is_initialized():
        if num_cpus:
            warn("--num-cpus is ignored: this process already runs Ray")
        return False
    if os.environ.get("RAY_ADDRESS"):
        if num_cpus:
            warn(f"--num-cpus is ignored: connecting to the running Ray at RAY_ADDRESS={os.environ['RAY_ADDRESS']}")
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, logging_level=logging.ERROR)
    else:
        # address="local": a new Ray even when another one runs on this machine (its num_cpus would be refused)
        ray.init(address="local", num_cpus=num_cpus or max(2, os.cpu_count() or 2), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.ERROR)
    return True


def _blocks(reader: RecordReader) -> Iterator[tuple[list[str], float]]:
    """Blocks (texts, input bytes read up to the block's end), in input order."""
    texts: list[str] = []
    block_bytes = 0
    for text, nbytes in reader:
        texts.append(text)
        block_bytes += nbytes
        if block_bytes >= BLOCK_BYTES or len(texts) >= BLOCK_DOCS:
            yield texts, reader.input_bytes
            texts, block_bytes = [], 0
    if texts:
        yield texts, reader.input_bytes


def tokenize_and_pack(reader: RecordReader, writer, tokenizer_json: str, tokenizer_sha256: str,
                      eos_id: int, num_cpus: int | None, progress: Progress, stats: dict) -> None:
    """Encode the records in Ray tasks and feed `writer` in input order; Ray starts once the first block is read,
    so bad inputs at the start fail fast without it."""
    in_flight: deque = deque()  # (ref, documents, input bytes read), in input order
    encode = tok_ref = None
    progress.begin(sum(s.bytes for s in reader.sources), "prepare: reading")

    def finish_oldest() -> None:
        ref, documents, read = in_flight.popleft()
        writer.add_stream(ray.get(ref), documents=documents)
        progress.update(read, writer.result.documents, writer.result.stream_tokens)

    try:
        for texts, read in _blocks(reader):
            if encode is None:
                import ray

                t0 = time.perf_counter()
                progress.restart("prepare: starting Ray")
                stats["started_ray"] = start_ray(num_cpus, lambda m: progress.message(f"warning: {m}"))
                stats["ray_start_s"] = time.perf_counter() - t0
                window = min(MAX_WINDOW, WINDOW_PER_CPU * max(1, int(ray.cluster_resources().get("CPU", 1))))
                encode = ray.remote(num_cpus=1)(_encode_block)
                tok_ref = ray.put(tokenizer_json)  # once: each task gets a reference, each worker parses it once
                progress.restart("prepare")
            in_flight.append((encode.remote(texts, tok_ref, tokenizer_sha256, eos_id), len(texts), read))
            while len(in_flight) >= window:
                finish_oldest()
        while in_flight:
            finish_oldest()
    finally:
        for ref, *_ in in_flight:  # an error or an interrupt: the tasks still queued are not needed
            with suppress(Exception):  # never hide the error that got us here
                ray.cancel(ref)
    if writer.result.documents != reader.documents:
        raise RuntimeError(f"{reader.documents} documents were read but {writer.result.documents} came back from Ray")
