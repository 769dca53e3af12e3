"""Throughput of `ray_jobs.prepare` next to a single-process `tokenizers` encode_batch, same text, same run.

    python -m bench.prepare [--num-cpus 2] [--scale 8] [--repeats 3]
    python -m bench.prepare --big-gb 1 [--big-cpus 1 2]   # a corpus of that size, peak RSS of every process

bench/README-prepare.md has the details. Writes prepare.json or prepare_big.json.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import Sampler, add_model_args, memory, write_json

ROOT = Path(__file__).resolve().parents[1]


def best_of(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def baseline(tok, texts: list[str], repeats: int, parallel: bool) -> float:
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if parallel else "false"
    try:
        return best_of(lambda: tok.encode_batch_fast(texts, add_special_tokens=False), repeats)
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def prepare_once(corpus: Path, out: Path, tok_path: Path, seq_len: int) -> dict:
    from ray_jobs import prepare as PR
    from ray_jobs.prepare_pipeline import Progress

    argv = ["--input", str(corpus), "--output", str(out), "--tokenizer", str(tok_path), "--seq-len", str(seq_len),
            "--overwrite"]
    args = PR.build_parser().parse_args(argv)
    stats: dict = {}
    cpu = time.process_time()
    PR.run(args, argv, progress=Progress(io.StringIO()), stats=stats)
    stats["driver_cpu_s"] = time.process_time() - cpu
    return stats


def _encode_table(batch, tokenizer_json: str, tokenizer_sha256: str, eos_id: int):
    """Ray Data UDF: a table of texts -> a table of their token ids (the task's work, through Ray Data)."""
    import pyarrow as pa

    from ray_jobs.prepare_pipeline import _encode_block

    return pa.table({"ids": _encode_block(batch.column("text").to_pylist(), tokenizer_json, tokenizer_sha256, eos_id)})


def prepare_ray_data(corpus: Path, out: Path, tok_path: Path, seq_len: int) -> dict:
    """The same work through Ray Data: the previous pipeline's structure, for comparison."""
    import pyarrow as pa
    import ray
    import ray.data

    from minilm import packing
    from minilm.data import file_sha256
    from ray_jobs.prepare_inputs import RecordReader, resolve_inputs
    from ray_jobs.prepare_pipeline import _blocks

    t0, cpu = time.perf_counter(), time.process_time()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order, ctx.enable_progress_bars = True, False
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.ERROR)
    reader = RecordReader(resolve_inputs([str(corpus)]), "text", "error")
    writer = packing.ShardWriter(out, seq_len)
    refs = [ray.put(pa.table({"text": pa.array(texts, pa.large_string())})) for texts, _, _ in _blocks(reader)]
    ds = ray.data.from_arrow_refs(refs).map_batches(
        _encode_table, batch_format="pyarrow", batch_size=None, num_cpus=1,
        fn_kwargs={"tokenizer_json": tok_path.read_text(encoding="utf-8"), "tokenizer_sha256": file_sha256(tok_path),
                   "eos_id": 2})
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=2):
        writer.add_stream(batch["ids"])
    writer.close()
    return {"elapsed_s": time.perf_counter() - t0, "driver_cpu_s": time.process_time() - cpu}


def prepare_one_process(corpus: Path, out: Path, tok_path: Path, seq_len: int) -> dict:
    """The same work in one process, no Ray: encode_batch_fast on every core, 4 MB of text at a time."""
    from minilm import packing
    from minilm import tokenizer as T
    from ray_jobs.prepare_inputs import RecordReader, resolve_inputs

    t0, cpu = time.perf_counter(), time.process_time()
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        tok = T.load_tokenizer(tok_path)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        writer = packing.ShardWriter(out, seq_len)
        texts, nbytes = [], 0
        for text, n in RecordReader(resolve_inputs([str(corpus)]), "text", "error"):
            texts.append(text)
            nbytes += n
            if nbytes >= 4 << 20:
                for e in tok.encode_batch_fast(texts, add_special_tokens=False):
                    writer.add_document(e.ids)
                texts, nbytes = [], 0
        for e in tok.encode_batch_fast(texts, add_special_tokens=False):
            writer.add_document(e.ids)
        writer.close()
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old
    return {"elapsed_s": time.perf_counter() - t0, "driver_cpu_s": time.process_time() - cpu}


def row(name: str, seconds: float, text_bytes: int, tokens: int) -> dict:
    return {"name": name, "seconds": round(seconds, 4), "mb_per_s": round(text_bytes / 1e6 / seconds, 3),
            "tokens_per_s": round(tokens / seconds), "text_bytes": text_bytes, "tokens": tokens}


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(prog="python -m bench.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--scale", type=int, default=8, help="also measure the corpus repeated this many times")
    p.add_argument("--repeats", type=int, default=3)
    add_model_args(p, ("seq_len",), seq_len=512)
    p.add_argument("--big-gb", type=float, default=0, help="prepare a corpus of this many GB instead (see above)")
    p.add_argument("--big-cpus", type=int, nargs="+", default=[1, 2], help="cores of each --big-gb run")
    p.add_argument("--dir", default=None, help="--big-gb: where to write the corpus and the dataset (default: the "
                                               "system temp folder)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.big_gb:
        return big_mode(args)

    import ray

    rows: list[dict] = []
    notes: dict = {"loadavg_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        info, texts, tok, tok_path = demo_inputs(tmp, notes)
        text_bytes = sum(len(t.encode()) for t in texts)
        tokens = sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts, add_special_tokens=False))
        big = tmp / "demo-x.jsonl"
        big.write_bytes((tmp / "demo.jsonl").read_bytes() * args.scale)

        e2e = end_to_end(tmp, args, notes)
        if e2e is None:
            return 1

        for scale, corpus in ((1, tmp / "demo.jsonl"), (args.scale, big)):
            label = "demo" if scale == 1 else f"demo x{scale}"
            all_texts = texts * scale
            for cores, parallel in (("all cores", True), ("1 core", False)):
                rows.append(row(f"{label}: encode_batch_fast, 1 process, {cores}",
                                baseline(tok, all_texts, args.repeats, parallel), text_bytes * scale, tokens * scale))
            if scale == 1:
                rows.append(row(f"{label}: python -m ray_jobs.prepare end to end (Ray start, BPE training)", e2e,
                                text_bytes, tokens))
                t0 = time.perf_counter()
                ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False,
                         logging_level="ERROR")
                notes["ray_init_s"] = round(time.perf_counter() - t0, 3)
                cold = prepare_once(corpus, tmp / "out", tok_path, args.seq_len)
                rows.append(row(f"{label}: prepare, cold (first run on a fresh Ray, {args.num_cpus} CPUs)",
                                cold["elapsed_s"], text_bytes, tokens))
            rows += warm_rows(label, corpus, tmp, tok_path, args, text_bytes * scale, tokens * scale)
        for r in rows:
            base = next(b for b in rows if b["name"].split(":")[0] == r["name"].split(":")[0])
            r["vs_encode_batch_all_cores"] = round(r["mb_per_s"] / base["mb_per_s"], 3)
        ray.shutdown()
    print_rows(rows, notes)
    result = {
        "rows": rows, "notes": notes,
        "corpus": {"documents": info["documents"], "text_bytes": text_bytes, "tokens": tokens, "scale": args.scale},
        "machine": {"cpus": os.cpu_count(), "num_cpus_ray": args.num_cpus, "python": platform.python_version(),
                    "platform": platform.platform(), "loadavg_at_end": os.getloadavg()},
        "versions": versions(),
    }
    print(f"wrote {write_json('prepare.json', result)}")
    return 0


def demo_inputs(tmp: Path, notes: dict):
    """The demo corpus written to tmp/demo.jsonl and a tokenizer trained on it (both timed into `notes`)."""
    from minilm import tokenizer as T
    from minilm.corpus import write_demo_corpus

    t0 = time.perf_counter()
    info = write_demo_corpus(tmp / "demo.jsonl")
    notes["corpus_extract_s"] = round(time.perf_counter() - t0, 3)
    texts = [json.loads(line)["text"] for line in (tmp / "demo.jsonl").read_text(encoding="utf-8").splitlines()]
    t0 = time.perf_counter()
    tok = T.train_tokenizer(texts, T.DEFAULT_VOCAB_SIZE)
    notes["tokenizer_train_s"] = round(time.perf_counter() - t0, 3)
    return info, texts, tok, T.save_tokenizer(tok, tmp / "tokenizer.json")


def warm_rows(label: str, corpus: Path, tmp: Path, tok_path: Path, args, text_bytes: int, tokens: int) -> list[dict]:
    """Prepare on the warm Ray, through Ray Data and in one process, alternating `--repeats` times (so background
    load hits every variant alike): the best of each."""
    variants = {f"prepare, warm ({args.num_cpus} CPUs)": prepare_once,
                f"the same through Ray Data, warm ({args.num_cpus} CPUs)": prepare_ray_data,
                "the same in one process, no Ray": prepare_one_process}
    timed: dict[str, list[dict]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            timed[name].append(fn(corpus, tmp / "out", tok_path, args.seq_len))
    rows = []
    for name, runs in timed.items():
        best = min(runs, key=lambda st: st["elapsed_s"])
        rows.append({**row(f"{label}: {name}", best["elapsed_s"], text_bytes, tokens),
                     "driver_cpu_s": round(best["driver_cpu_s"], 3)})
    return rows


def end_to_end(tmp: Path, args, notes: dict) -> float | None:
    """`python -m ray_jobs.prepare` as a user runs it (its own local Ray, a tokenizer trained on the input): its
    seconds, or None (its error printed) if it failed."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "ray_jobs.prepare", "--input", str(tmp / "demo.jsonl"), "--output",
                        str(tmp / "e2e"), "--num-cpus", str(args.num_cpus), "--seq-len", str(args.seq_len)],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return None
    notes["end_to_end_summary_line"] = r.stderr.strip().splitlines()[-1]
    return time.perf_counter() - t0


def print_rows(rows: list[dict], notes: dict) -> None:
    width = max(len(r["name"]) for r in rows)
    print(f"{'':{width}}  {'seconds':>8}  {'MB/s':>7}  {'tokens/s':>10}  {'x baseline':>10}  {'driver CPU s':>12}")
    for r in rows:
        cpu = f"{r['driver_cpu_s']:.2f}" if "driver_cpu_s" in r else ""
        print(f"{r['name']:{width}}  {r['seconds']:8.3f}  {r['mb_per_s']:7.2f}  {r['tokens_per_s']:10,}  "
              f"{r['vs_encode_batch_all_cores']:10.2f}  {cpu:>12}")
    for k, v in notes.items():
        print(f"{k}: {v}")


# ---- --big-gb ---------------------------------------------------------------------------------------------

def write_big_corpus(demo: Path, out: Path, target_bytes: int) -> dict:
    """The demo corpus repeated until `target_bytes`, copy k in the document order of a permutation seeded by k."""
    import numpy as np

    lines = demo.read_bytes().splitlines(keepends=True)
    copies = 0
    with open(out, "wb") as f:
        while f.tell() < target_bytes:
            for i in np.random.default_rng(copies).permutation(len(lines)):
                f.write(lines[i])
            copies += 1
        size = f.tell()
    return {"bytes": size, "copies": copies, "documents": copies * len(lines)}


def process_tree(root) -> dict[int, tuple[str, int]]:
    """Each process under `root` (a psutil.Process, itself included): its name and peak RSS so far."""
    import psutil

    out = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for proc in procs:
        try:
            name = " ".join(proc.cmdline()[:3])[:80]
            m = memory(proc.pid)
        except (psutil.Error, OSError):
            continue
        out[proc.pid] = (name, max(m["rss"], m["hwm"]))
    return out


def big_run(corpus: Path, tok_path: Path, out: Path, cpus: int, seq_len: int) -> dict:
    import psutil

    cores = sorted(os.sched_getaffinity(0))[:cpus]
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ray_jobs.prepare", "--input", str(corpus), "--output", str(out),
                             "--tokenizer", str(tok_path), "--seq-len", str(seq_len), "--num-cpus", str(cpus),
                             "--overwrite"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    root = psutil.Process(proc.pid)
    with Sampler(lambda: process_tree(root), 0.5) as sampler:
        _, err = proc.communicate()
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"prepare exited {proc.returncode}: {err[-2000:]}")
    summary = err.strip().splitlines()[-1]
    peaks: dict[int, dict] = {}  # pid -> its name (Ray's title once it has one) and peak RSS
    for _, tree in sampler.samples:
        for pid, (name, rss) in tree.items():
            entry = peaks.setdefault(pid, {"name": name, "rss": 0})
            entry["rss"] = max(entry["rss"], rss)
            entry["name"] = name if "ray::" in name else entry["name"]
    driver = peaks.pop(proc.pid)
    workers = {pid: p for pid, p in peaks.items() if "ray::" in p["name"] or "default_worker" in p["name"]}
    return {"cpus": cpus, "wall_s": wall, "summary": summary, "driver_peak_rss": driver["rss"],
            "worker_peak_rss": max((p["rss"] for p in workers.values()), default=0),
            "workers": len(workers), "other_processes": {p["name"]: p["rss"] for pid, p in peaks.items()
                                                         if pid not in workers},
            "load_average": os.getloadavg()}


def big_mode(args) -> int:
    import re

    from minilm import tokenizer as T
    from minilm.corpus import write_demo_corpus

    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-big-", dir=args.dir) as tmp:
        tmp = Path(tmp)
        if shutil.disk_usage(tmp).free < args.big_gb * 1.6e9:
            print(f"error: --big-gb {args.big_gb} needs {args.big_gb * 1.6:.1f} GB free in {tmp}", file=sys.stderr)
            return 2
        write_demo_corpus(tmp / "demo.jsonl")
        texts = [json.loads(line)["text"] for line in (tmp / "demo.jsonl").read_text(encoding="utf-8").splitlines()]
        tok_path = T.save_tokenizer(T.train_tokenizer(texts, T.DEFAULT_VOCAB_SIZE), tmp / "tokenizer.json")
        corpus = write_big_corpus(tmp / "demo.jsonl", tmp / "big.jsonl", int(args.big_gb * 1e9))
        for cpus in args.big_cpus:
            run = big_run(tmp / "big.jsonl", tok_path, tmp / "out", cpus, args.seq_len)
            m = re.search(r"tokenized at ([0-9.]+) MB/s", run["summary"])
            run["pipeline_mb_per_s"] = float(m.group(1)) if m else None
            manifest = json.loads((tmp / "out" / "manifest.json").read_text())
            run["text_bytes"] = manifest["text_bytes"]
            run["wall_mb_per_s"] = manifest["text_bytes"] / 1e6 / run["wall_s"]
            run["fingerprint"] = manifest["fingerprint"]
            runs.append(run)
            print(f"# {cpus} core(s): {run['summary']}", flush=True)
    print(f"# corpus: {corpus['bytes'] / 1e9:.2f} GB JSONL ({corpus['copies']} copies of the demo corpus, "
          f"{corpus['documents']:,} documents), seq {args.seq_len}, tokenizer given")
    print(f"{'cores':>5} {'wall s':>8} {'MB/s pipeline':>14} {'MB/s wall':>10} {'driver peak':>12} "
          f"{'worker peak':>12} {'workers':>8} {'load':>6}")
    for r in runs:
        print(f"{r['cpus']:>5} {r['wall_s']:>8.1f} {r['pipeline_mb_per_s'] or float('nan'):>14.2f} "
              f"{r['wall_mb_per_s']:>10.2f} {r['driver_peak_rss'] / 2**20:>10.0f}MB {r['worker_peak_rss'] / 2**20:>10.0f}MB "
              f"{r['workers']:>8} {r['load_average'][0]:>6.2f}")
    best = {c: max(r["wall_mb_per_s"] for r in runs if r["cpus"] == c) for c in {r["cpus"] for r in runs}}
    if len(best) > 1:
        few, many = min(best), max(best)
        print(f"speed-up {many} cores / {few}: {best[many] / best[few]:.2f}x (best wall MB/s of each)")
        print("same fingerprint in every run:", len({r["fingerprint"] for r in runs}) == 1)
    path = write_json("prepare_big.json", {"corpus": corpus, "runs": runs, "versions": versions(),
                                           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                                       "load_average_at_end": os.getloadavg()}})
    print(f"wrote {path}")
    return 0


def versions() -> dict:
    import pyarrow
    import ray
    import tokenizers

    return {"ray": ray.__version__, "tokenizers": tokenizers.__version__, "pyarrow": pyarrow.__version__}


if __name__ == "__main__":
    sys.exit(main())
