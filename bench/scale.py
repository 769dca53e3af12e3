"""Memory of the data stream at scale: per-process RSS growth against the dataset size (target < 300 MB).

    python -m bench.scale                                   # 0.25B and 1B tokens, 2 ranks, 200k samples each

bench/README.md has the details. Writes scale.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import Sampler, add_model_args, environment, memory, write_json

MB = 1 << 20


# ---- the synthetic dataset -------------------------------------------------------------------------

def write_synthetic(out: Path, num_tokens: int, seq_len: int, vocab_size: int, seed: int = 0):
    """A prepared dataset of about `num_tokens` random ids by the real writer; a stand-in tokenizer file."""
    from minilm import data as D
    from minilm import packing as P
    from minilm import tokenizer as T

    out.mkdir(parents=True)
    dtype = D.token_dtype_for(vocab_size)
    writer = P.ShardWriter(out, seq_len, token_dtype=dtype)
    rng = np.random.default_rng(seed)
    left = num_tokens - num_tokens % (seq_len + 1)
    while left:
        n = min(left, 1 << 24)
        writer.add_stream(rng.integers(3, vocab_size, n, dtype=D.TOKEN_DTYPES[dtype]))
        left -= n
    result = writer.close()
    T.save_tokenizer(T.train_tokenizer(["a stand-in tokenizer for a synthetic dataset"] * 4, T.MIN_VOCAB_SIZE),
                     out / D.TOKENIZER_FILE)
    tokenizer = {"path": D.TOKENIZER_FILE, "source": "synthetic", "sha256": D.file_sha256(out / D.TOKENIZER_FILE),
                 "vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    manifest = P.build_manifest(result, tokenizer=tokenizer, inputs=[], documents_read=0, documents_skipped=0,
                                skipped_by_reason={}, command=f"bench.scale write_synthetic {num_tokens}")
    P.write_manifest(out, manifest)
    data = D.PreparedData(out, manifest)
    D.record_verified(data)  # hashed as written
    return data


# ---- the page cache --------------------------------------------------------------------------------

def drop_page_cache(paths: list[Path]) -> None:
    """Evict these files' clean pages (no root needed), so the stream starts from a cold cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(paths: list[Path]) -> int:
    """Bytes of these files in the page cache (mincore over a read-only mapping of each)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {p}")
            try:
                vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {p}")
                total += sum(b & 1 for b in bytes(vec)) * page
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
    return total


# ---- the ranks ---------------------------------------------------------------------------------------

class Rank:
    """One rank of a world of 2, in its own Ray actor: the real RankStream, timed, with its RSS."""

    def __init__(self, data: str, rank: int, world_size: int, micro_batch_size: int, accumulation: int,
                 samples: int, num_sequences: int, seed: int):
        self.args = (data, rank, world_size, micro_batch_size, accumulation, samples, num_sequences, seed)

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> dict:
        import torch

        from minilm import data as D
        from ray_jobs.stream import RankStream

        data, rank, world, m, accumulation, samples, num_sequences, seed = self.args
        seq_len = D.open_prepared(data, verify=False).seq_len
        G = m * accumulation * world
        steps = max(2, samples // (G // world))
        before = memory()
        order = D.RankOrder(None, seed, D.steps_per_epoch(num_sequences, G), G, world, rank, 0,
                            num_sequences=num_sequences)  # the training ids are all of them
        stream = RankStream(data, order, steps, m, torch.device("cpu"))
        stream.next_step()
        after_first, first_step_done = memory(), time.time()
        t0, wait0, rows = time.perf_counter(), stream.data_wait_s, 0
        for _ in range(steps - 1):
            batches, _ = stream.next_step()
            rows += sum(len(b) for b in batches)
        elapsed = time.perf_counter() - t0
        end = memory()
        wait = stream.data_wait_s - wait0
        del stream, batches
        return {"rank": rank, "pid": os.getpid(), "steps": steps, "rows": rows + G // world,
                "before": before, "after_first": after_first, "end": end,
                "first_step_done": first_step_done, "tokens_per_s": rows * seq_len / elapsed, "elapsed_s": elapsed,
                "wait_s": wait}


def ranks_and_readers(rank_pids: list[int]) -> dict[int, tuple[str, dict]]:
    """memory() of the rank actors and of every Ray Data reader actor (ReadSequences), by pid."""
    import psutil

    pids = [(pid, "rank") for pid in rank_pids] + [
        (proc.info["pid"], "reader") for proc in psutil.process_iter(["pid", "cmdline"])
        if any("ReadSequences" in part for part in proc.info["cmdline"] or [])]
    out = {}
    for pid, kind in pids:
        try:
            out[pid] = (kind, memory(pid))
        except OSError:
            continue
    return out


def measure(data_dir: Path, args, seed: int) -> dict:
    import ray

    from minilm import data as D

    data = D.open_prepared(data_dir)
    files = data.shard_paths
    drop_page_cache(files)
    cached_before = resident_bytes(files)
    actor = ray.remote(num_cpus=0)(Rank)
    ranks = [actor.remote(str(data_dir), r, 2, args.micro_batch_size, args.accumulation, args.samples,
                          data.num_sequences, seed) for r in range(2)]
    pids = ray.get([r.pid.remote() for r in ranks])
    with Sampler(lambda: ranks_and_readers(pids), 0.2) as sampler:
        results = ray.get([r.run.remote() for r in ranks])
    samples: dict[int, list[tuple[float, dict]]] = {}  # pid -> (time, memory())
    names: dict[int, str] = {}
    for t, seen in sampler.samples:
        for pid, (kind, value) in seen.items():
            samples.setdefault(pid, []).append((t, value))
            names[pid] = kind
    for r in ranks:
        ray.kill(r)
    cached_after = resident_bytes(files)
    # A reader's baseline is its memory once both ranks have their first step (imports and start-up done).
    started = max(r["first_step_done"] for r in results)
    processes = []
    for r in results:
        seen = [v for t, v in samples.get(r["pid"], []) if t >= r["first_step_done"]]
        processes.append(summarise(f"rank {r['rank']}", r["after_first"], [*seen, r["end"]], r["before"]))
    for pid, values in sorted(samples.items()):
        seen = [v for t, v in values if t >= started]
        if names[pid] == "reader" and len(seen) > 1:
            processes.append(summarise("reader", seen[0], seen))
    return {"tokens": data.num_sequences * (data.seq_len + 1), "num_sequences": data.num_sequences,
            "bytes_on_disk": data.num_bytes, "shards": len(files), "ranks": results, "processes": processes,
            "page_cache_before": cached_before, "page_cache_after": cached_after,
            "load_average": os.getloadavg()}


def summarise(name: str, base: dict, seen: list[dict], before: dict | None = None) -> dict:
    """Growth of RSS and of private memory from `base` (after the first step) to the end and to the peak."""
    end = seen[-1]
    return {"process": name, "rss_before": before["rss"] if before else None, "rss_base": base["rss"],
            "rss_end": end["rss"], "rss_peak": max(v["rss"] for v in seen),
            "rss_growth": end["rss"] - base["rss"], "rss_peak_growth": max(v["rss"] for v in seen) - base["rss"],
            "anon_growth": end["anon"] - base["anon"], "anon_peak_growth": max(v["anon"] for v in seen) - base["anon"],
            "shmem_end": end["shmem"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=float, nargs="+", default=[0.25e9, 1e9], help="dataset sizes, in tokens")
    p.add_argument("--samples", type=int, default=200_000, help="sequences each rank reads")
    add_model_args(p, ("seq_len", "vocab_size", "micro_batch_size"), seq_len=512, micro_batch_size=32)
    p.add_argument("--accumulation", type=int, default=4)
    p.add_argument("--dir", default=None, help="where to write the datasets (default: the system temp folder)")
    args = p.parse_args(argv)

    from ray_jobs.cli import ensure_ray

    ensure_ray()
    rows = []
    for i, tokens in enumerate(args.tokens):
        need = int(tokens) * 2 * 1.05 + (1 << 30)
        free = shutil.disk_usage(args.dir or tempfile.gettempdir()).free
        if free < need:
            print(f"error: {tokens:.3g} tokens need {need / 1e9:.1f} GB free, {free / 1e9:.1f} GB there (--dir)",
                  file=sys.stderr)
            return 2
        with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.dir) as tmp:
            t0 = time.perf_counter()
            write_synthetic(Path(tmp) / "data", int(tokens), args.seq_len, args.vocab_size, seed=i)
            write_s = time.perf_counter() - t0
            row = measure(Path(tmp) / "data", args, seed=i)
            row["write_s"] = write_s
            rows.append(row)
            print_row(row)
    result = {"args": vars(args), "environment": environment(), "rows": rows}
    print_table(rows)
    path = write_json("scale.json", result)
    print(f"wrote {path}")
    return 0


def print_row(row: dict) -> None:
    print(f"# {row['tokens'] / 1e9:.3g}B tokens ({row['bytes_on_disk'] / 1e9:.2f} GB in {row['shards']} files, written "
          f"in {row['write_s']:.1f} s), load average {row['load_average'][0]:.2f}", flush=True)


def print_table(rows: list[dict]) -> None:
    print("RSS = private (anon) + mapped files + shared memory (Ray's object store pages the process has touched);")
    print("growth and peak growth are from the RSS after the first step; private growth is anon memory alone.")
    print(f"{'dataset':>8} {'process':>8} {'before':>7} {'step 1':>7} {'end':>7} {'peak':>7} {'growth':>7} "
          f"{'peak gr.':>8} {'private gr.':>11} {'priv. peak gr.':>14} {'obj. store':>10} {'tokens/s':>9}")
    for row in rows:
        size = f"{row['tokens'] / 1e9:.3g}B"
        rates = {f"rank {r['rank']}": r["tokens_per_s"] for r in row["ranks"]}
        for p in row["processes"]:
            before = f"{p['rss_before'] / MB:.0f}" if p["rss_before"] is not None else "-"
            rate = f"{rates[p['process']] / 1e6:.2f}M" if p["process"] in rates else ""
            print(f"{size:>8} {p['process']:>8} {before:>7} {p['rss_base'] / MB:>7.0f} {p['rss_end'] / MB:>7.0f} "
                  f"{p['rss_peak'] / MB:>7.0f} {p['rss_growth'] / MB:>7.0f} {p['rss_peak_growth'] / MB:>8.0f} "
                  f"{p['anon_growth'] / MB:>11.0f} {p['anon_peak_growth'] / MB:>14.0f} {p['shmem_end'] / MB:>10.0f} "
                  f"{rate:>9}")
        print(f"{size:>8} page cache of the dataset: {row['page_cache_before'] / MB:.0f} MB before, "
              f"{row['page_cache_after'] / MB:.0f} MB after ({row['page_cache_after'] / row['bytes_on_disk']:.0%} "
              f"of its {row['bytes_on_disk'] / MB:.0f} MB); load average {row['load_average'][0]:.2f}")
    print("(MB; 1 MB = 2^20 bytes)")


if __name__ == "__main__":
    sys.exit(main())
