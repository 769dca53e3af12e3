"""Tokenize + pack throughput and memory of `python -m ray_jobs.prepare`: a corpus of --big-gb GB (the demo corpus
repeated) through the real command line on 1 and 2 cores, peak RSS of every process, next to a single-process
`tokenizers` encode_batch_fast of the same text. bench/README-prepare.md has the details. Writes prepare.json."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from .common import add_model_args, child_env, environment, machine, memory, table, write_json

ROOT = Path(__file__).resolve().parents[1]
SAMPLE_BYTES = 16 << 20  # encode_batch_fast's sample: the corpus's first 16 MB, held in memory


def process_tree(pid: int) -> dict[int, tuple[str, int]]:
    """Each process under `pid` (itself included): its name and peak RSS so far."""
    import psutil

    out = {}
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            m = memory(proc.pid)
            out[proc.pid] = (" ".join(proc.cmdline()[:3])[:80], max(m["rss"], m["hwm"]))
        except (psutil.Error, OSError, KeyError):
            continue
    return out


def run(corpus: Path, tok_path: Path, out: Path, cpus: int, seq_len: int) -> dict:
    """The real command line pinned to `cpus` cores (a local Ray of as many CPUs), every process's RSS sampled."""
    cores, peaks = sorted(os.sched_getaffinity(0))[:cpus], {}  # pid -> its name (Ray's title once it has one), peak
    t0 = time.perf_counter()
    with open(out.with_suffix(".log"), "w+") as log:
        proc = subprocess.Popen([sys.executable, "-m", "ray_jobs.prepare", "--input", str(corpus), "--output",
                                 str(out), "--tokenizer", str(tok_path), "--seq-len", str(seq_len), "--num-cpus",
                                 str(cpus), "--overwrite"], cwd=ROOT, env=child_env(), stdout=log,
                                stderr=subprocess.STDOUT, text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
        while proc.poll() is None:
            for pid, (name, rss) in process_tree(proc.pid).items():
                entry = peaks.setdefault(pid, {"name": name, "rss": 0})
                entry["rss"], entry["name"] = max(entry["rss"], rss), name if "ray::" in name else entry["name"]
            time.sleep(0.5)
        wall = time.perf_counter() - t0
        log.seek(0)
        output = log.read()
    if proc.returncode != 0:
        raise RuntimeError(f"prepare exited {proc.returncode}: {output[-2000:]}")
    driver = peaks.pop(proc.pid)
    workers = {pid for pid, p in peaks.items() if "ray::" in p["name"] or "default_worker" in p["name"]}
    summary = [line for line in output.splitlines() if line.startswith("prepared ")][-1]  # its summary line
    found = re.search(r"tokenized at ([0-9.]+) MB/s", summary)
    manifest = json.loads((out / "manifest.json").read_text())
    return {"cpus": cpus, "wall_s": wall, "summary": summary, "driver_peak_rss": driver["rss"],
            "worker_peak_rss": max((peaks[pid]["rss"] for pid in workers), default=0), "workers": len(workers),
            "other_processes": {p["name"]: p["rss"] for pid, p in peaks.items() if pid not in workers},
            "load_average": os.getloadavg(), "pipeline_mb_per_s": float(found.group(1)) if found else None,
            "text_bytes": manifest["text_bytes"], "wall_mb_per_s": manifest["text_bytes"] / 1e6 / wall,
            "fingerprint": manifest["fingerprint"]}


def encode_baseline(tok, texts: list[str], repeats: int) -> dict:
    """MB/s of one process's encode_batch_fast over `texts`, Rayon's threads on every core and on one: best of
    `repeats`."""
    rates, mb = {}, sum(len(t.encode()) for t in texts) / 1e6
    for cores, parallel in (("all cores", "true"), ("1 core", "false")):
        with mock.patch.dict(os.environ, TOKENIZERS_PARALLELISM=parallel):
            seconds = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                tok.encode_batch_fast(texts, add_special_tokens=False)
                seconds.append(time.perf_counter() - t0)
        rates[cores] = mb / min(seconds)
    return {"text_mb": mb, "mb_per_s": rates}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prepare", description=__doc__)
    p.add_argument("--big-gb", type=float, default=0.016, help="the corpus's size (default: 8x the demo corpus)")
    p.add_argument("--big-cpus", type=int, nargs="+", default=[1, 2], help="cores of each prepare run")
    p.add_argument("--repeats", type=int, default=3, help="encode_batch_fast runs, the best counts")
    add_model_args(p, ("seq_len",), seq_len=512)
    p.add_argument("--dir", default=None, help="where to write the corpus and the dataset (default: the system temp "
                                               "folder)")
    args = p.parse_args(argv)
    import numpy as np

    from minilm import tokenizer as T
    from minilm.corpus import write_demo_corpus

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-", dir=args.dir) as tmp:
        tmp = Path(tmp)
        if shutil.disk_usage(tmp).free < args.big_gb * 1.6e9:
            p.error(f"--big-gb {args.big_gb} needs {args.big_gb * 1.6:.1f} GB free in {tmp}")
        write_demo_corpus(tmp / "demo.jsonl")
        lines = (tmp / "demo.jsonl").read_bytes().splitlines(keepends=True)
        texts = [json.loads(line)["text"] for line in lines]
        tok = T.train_tokenizer(texts, T.DEFAULT_VOCAB_SIZE)
        tok_path = T.save_tokenizer(tok, tmp / "tokenizer.json")
        with open(tmp / "corpus.jsonl", "wb") as f:  # copy k in the document order of a permutation seeded by k
            copies = 0
            while f.tell() < args.big_gb * 1e9:
                f.writelines(lines[i] for i in np.random.default_rng(copies).permutation(len(lines)))
                copies += 1
            corpus = {"bytes": f.tell(), "copies": copies, "documents": copies * len(lines)}
        repeat = max(1, min(copies, SAMPLE_BYTES // sum(map(len, lines))))  # the texts of the corpus's first copies
        baseline = encode_baseline(tok, texts * repeat, args.repeats)
        for cpus in args.big_cpus:
            runs.append(run(tmp / "corpus.jsonl", tok_path, tmp / "out", cpus, args.seq_len))
            print(f"# {cpus} core(s): {runs[-1]['summary']}", flush=True)
    env, rate = environment(), baseline["mb_per_s"]["all cores"]
    print(f"{machine(env)}\n# corpus: {corpus['bytes'] / 1e9:.3f} GB JSONL ({corpus['copies']} copies of the demo "
          f"corpus, {corpus['documents']:,} documents), seq {args.seq_len}, tokenizer given")
    print(f"one process's encode_batch_fast ({baseline['text_mb']:.1f} MB of it, best of {args.repeats}): "
          + ", ".join(f"{v:.2f} MB/s on {k}" for k, v in baseline["mb_per_s"].items()))
    print(table(["cores", "wall s", "MB/s pipeline", "x encode_batch", "MB/s wall", "driver peak", "worker peak",
                 "workers", "load"], [
        [r["cpus"], f"{r['wall_s']:.1f}", f"{r['pipeline_mb_per_s'] or float('nan'):.2f}",
         f"{(r['pipeline_mb_per_s'] or float('nan')) / rate:.2f}", f"{r['wall_mb_per_s']:.2f}",
         f"{r['driver_peak_rss'] / 2**20:.0f}MB", f"{r['worker_peak_rss'] / 2**20:.0f}MB", r["workers"],
         f"{r['load_average'][0]:.2f}"] for r in runs], left=0))
    best = {c: max(r["wall_mb_per_s"] for r in runs if r["cpus"] == c) for c in {r["cpus"] for r in runs}}
    if len(best) > 1:
        few, many = min(best), max(best)
        print(f"speed-up {many} cores / {few}: {best[many] / best[few]:.2f}x (best wall MB/s of each)")
        print("same fingerprint in every run:", len({r["fingerprint"] for r in runs}) == 1)
    write_json("prepare.json", {"corpus": corpus, "encode_batch": baseline, "runs": runs, "environment": env,
                                "versions": {m: importlib.metadata.version(m) for m in ("ray", "tokenizers", "pyarrow")}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
