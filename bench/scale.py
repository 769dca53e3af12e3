"""Memory of the data stream at scale: per-process RSS growth against the dataset size (target < 300 MB), 2 ranks
streaming random positions over synthetic datasets. bench/README.md has the details. Writes scale.json."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .common import add_model_args, environment, machine, memory, table, write_json

MB = 1 << 20


def write_synthetic(out: Path, num_tokens: int, seq_len: int, vocab_size: int, seed: int = 0):
    """A prepared dataset of about `num_tokens` random ids by the real writer; a stand-in tokenizer file."""
    from minilm import data as D
    from minilm import packing as P
    from minilm import tokenizer as T

    out.mkdir(parents=True)
    dtype = D.token_dtype_for(vocab_size)
    writer, rng = P.ShardWriter(out, seq_len, token_dtype=dtype), np.random.default_rng(seed)
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
    """Bytes of these files in the page cache (util-linux's fincore: mincore over a mapping of each)."""
    return sum(map(int, subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
                                       capture_output=True, text=True, check=True).stdout.split()))


class Rank:
    """One rank of a world of 2, in its own Ray actor: the real RankStream, timed, with its RSS."""

    def __init__(self, *args):
        self.args = args

    def run(self) -> dict:
        import torch

        from minilm import data as D
        from ray_jobs.stream import RankStream

        data, rank, world, m, accumulation, samples, num_sequences, seed = self.args
        seq_len, G = D.open_prepared(data, verify=False).seq_len, m * accumulation * world
        steps, before = max(2, samples // (G // world)), memory()
        order = D.RankOrder(None, seed, D.steps_per_epoch(num_sequences, G), G, world, rank, 0,
                            num_sequences=num_sequences)  # the training ids are all of them
        stream = RankStream(data, order, steps, m, torch.device("cpu"))
        stream.next_step()
        after_first = memory()
        t0, wait0, rows = time.perf_counter(), stream.data_wait_s, 0
        for _ in range(steps - 1):
            rows += sum(len(b) for b in stream.next_step()[0])
        elapsed, end, wait = time.perf_counter() - t0, memory(), stream.data_wait_s - wait0
        del stream
        return {"rank": rank, "steps": steps, "rows": rows + G // world, "tokens_per_s": rows * seq_len / elapsed,
                "elapsed_s": elapsed, "wait_s": wait, "memory": {  # RSS growth from after the first step
                    "process": f"rank {rank}", "rss_before": before["rss"], "rss_base": after_first["rss"],
                    "rss_end": end["rss"], "rss_peak": end["hwm"], "rss_growth": end["rss"] - after_first["rss"],
                    "rss_peak_growth": end["hwm"] - after_first["rss"], "anon_growth": end["anon"] - after_first["anon"],
                    "shmem_end": end["shmem"]}}


def measure(data_dir: Path, args, seed: int) -> dict:
    import ray

    from minilm import data as D

    data = D.open_prepared(data_dir)
    files = data.shard_paths
    drop_page_cache(files)
    cached_before = resident_bytes(files)
    ranks = [ray.remote(num_cpus=0)(Rank).remote(str(data_dir), r, 2, args.micro_batch_size, args.accumulation,
                                                 args.samples, data.num_sequences, seed) for r in range(2)]
    results = ray.get([r.run.remote() for r in ranks])
    for r in ranks:
        ray.kill(r)
    return {"tokens": data.num_sequences * (data.seq_len + 1), "num_sequences": data.num_sequences,
            "bytes_on_disk": data.num_bytes, "shards": len(files), "processes": [r.pop("memory") for r in results],
            "ranks": results,
            "page_cache_before": cached_before, "page_cache_after": resident_bytes(files),
            "load_average": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__)
    p.add_argument("--tokens", type=float, nargs="+", default=[0.25e9, 1e9], help="dataset sizes, in tokens")
    p.add_argument("--samples", type=int, default=200_000, help="sequences each rank reads")
    add_model_args(p, ("seq_len", "vocab_size", "micro_batch_size", "accumulation"), seq_len=512, micro_batch_size=32,
                   accumulation=4)
    p.add_argument("--dir", default=None, help="where to write the datasets (default: the system temp folder)")
    args = p.parse_args(argv)
    from ray_jobs.cli import ensure_ray

    ensure_ray()
    rows = []
    for i, tokens in enumerate(args.tokens):
        need, free = int(tokens) * 2 * 1.05 + (1 << 30), shutil.disk_usage(args.dir or tempfile.gettempdir()).free
        if free < need:
            p.error(f"{tokens:.3g} tokens need {need / 1e9:.1f} GB free, {free / 1e9:.1f} GB there (--dir)")
        with tempfile.TemporaryDirectory(prefix="bench-scale-", dir=args.dir) as tmp:
            t0 = time.perf_counter()
            write_synthetic(Path(tmp) / "data", int(tokens), args.seq_len, args.vocab_size, seed=i)
            r = {"write_s": time.perf_counter() - t0, **measure(Path(tmp) / "data", args, seed=i)}
        rows.append(r)
        print(f"# {r['tokens'] / 1e9:.3g}B tokens ({r['bytes_on_disk'] / 1e9:.2f} GB in {r['shards']} files, written "
              f"in {r['write_s']:.1f} s), load average {r['load_average'][0]:.2f}", flush=True)
    env = environment()
    print(machine(env))
    print("RSS = private (anon) + mapped files + shared memory (Ray's object store pages the process has touched);\n"
          "growth and peak growth are from the RSS after the first step; private growth is anon memory alone (MB)")
    print(table(["dataset", "process", "before", "step 1", "end", "peak", "growth", "peak gr.", "private gr.",
                 "obj. store", "tokens/s"], [
        [f"{row['tokens'] / 1e9:.3g}B", p["process"], *(f"{p[k] / MB:.0f}" for k in (
            "rss_before", "rss_base", "rss_end", "rss_peak", "rss_growth", "rss_peak_growth", "anon_growth",
            "shmem_end")), f"{r['tokens_per_s'] / 1e6:.2f}M"] for row in rows
        for p, r in zip(row["processes"], row["ranks"], strict=True)], left=0))
    for row in rows:
        print(f"{row['tokens'] / 1e9:.3g}B page cache of the dataset: {row['page_cache_before'] / MB:.0f} MB before, "
              f"{row['page_cache_after'] / MB:.0f} MB after ({row['page_cache_after'] / row['bytes_on_disk']:.0%} "
              f"of its {row['bytes_on_disk'] / MB:.0f} MB); load average {row['load_average'][0]:.2f}")
    write_json("scale.json", {"args": vars(args), "environment": env, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
