"""Throughput of `ray_jobs.prepare` next to a single-process `tokenizers` encode_batch, same text, same run.

    python -m bench.prepare [--num-cpus 2] [--scale 8] [--repeats 3]

Measures, on the built-in demo corpus (stdlib docstrings, ~2 MB) and on that corpus repeated
`--scale` times:

* baseline: one process, `Tokenizer.encode_batch_fast` over all texts (Rayon threads on every core,
  and with TOKENIZERS_PARALLELISM=false on one core);
* prepare: the Ray Data pipeline (read + check JSONL in the driver, encode in Ray tasks, pack, write
  parquet shards) on a local Ray of `--num-cpus` CPUs, with the tokenizer given (training excluded);
  "cold" is the first run after Ray starts (worker start-up included), "warm" the best later run;
* end to end: `python -m ray_jobs.prepare` as a user runs it (starts Ray, trains the tokenizer).

Throughput is of input text: MB/s of UTF-8 text and tokens/s (document tokens); "x baseline" is the
ratio to the all-cores encode_batch_fast of the same text. Prints a table and writes
bench/results/prepare.json (with the load average: on a shared machine, other processes skew it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "prepare.json"
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

    argv = ["--input", str(corpus), "--output", str(out), "--tokenizer", str(tok_path), "--seq-len", str(seq_len),
            "--overwrite"]
    args = PR.build_parser().parse_args(argv)
    stats: dict = {}
    cpu = time.process_time()
    PR.run(args, argv, progress=PR.Progress(io.StringIO()), stats=stats)
    stats["driver_cpu_s"] = time.process_time() - cpu
    return stats


def row(name: str, seconds: float, text_bytes: int, tokens: int) -> dict:
    return {"name": name, "seconds": round(seconds, 4), "mb_per_s": round(text_bytes / 1e6 / seconds, 3),
            "tokens_per_s": round(tokens / seconds), "text_bytes": text_bytes, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--num-cpus", type=int, default=2)
    p.add_argument("--scale", type=int, default=8, help="also measure the corpus repeated this many times")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512)
    args = p.parse_args(argv)

    import ray

    from minilm import tokenizer as T
    from minilm.corpus import write_demo_corpus

    rows: list[dict] = []
    notes: dict = {"loadavg_at_start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        info = write_demo_corpus(tmp / "demo.jsonl")
        notes["corpus_extract_s"] = round(time.perf_counter() - t0, 3)
        texts = [json.loads(line)["text"] for line in (tmp / "demo.jsonl").read_text(encoding="utf-8").splitlines()]
        text_bytes = sum(len(t.encode()) for t in texts)
        t0 = time.perf_counter()
        tok = T.train_tokenizer(texts, T.DEFAULT_VOCAB_SIZE)
        notes["tokenizer_train_s"] = round(time.perf_counter() - t0, 3)
        tok_path = T.save_tokenizer(tok, tmp / "tokenizer.json")
        tokens = sum(len(e.ids) + 1 for e in tok.encode_batch_fast(texts, add_special_tokens=False))
        big = tmp / "demo-x.jsonl"
        big.write_bytes((tmp / "demo.jsonl").read_bytes() * args.scale)

        # end to end, as a user runs it: its own local Ray, tokenizer trained on the input
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
        env.pop("RAY_ADDRESS", None)
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "ray_jobs.prepare", "--input", str(tmp / "demo.jsonl"), "--output",
                            str(tmp / "e2e"), "--num-cpus", str(args.num_cpus), "--seq-len", str(args.seq_len)],
                           cwd=ROOT, env=env, capture_output=True, text=True)
        e2e = time.perf_counter() - t0
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            return 1
        notes["end_to_end_summary_line"] = r.stderr.strip().splitlines()[-1]

        for scale, corpus in ((1, tmp / "demo.jsonl"), (args.scale, big)):
            label = "demo" if scale == 1 else f"demo x{scale}"
            all_texts = texts * scale
            rows.append(row(f"{label}: encode_batch_fast, 1 process, all cores", baseline(tok, all_texts, args.repeats,
                                                                                           True),
                            text_bytes * scale, tokens * scale))
            rows.append(row(f"{label}: encode_batch_fast, 1 process, 1 core", baseline(tok, all_texts, args.repeats,
                                                                                        False),
                            text_bytes * scale, tokens * scale))
            if scale == 1:
                rows.append(row(f"{label}: python -m ray_jobs.prepare end to end (Ray start, BPE training)", e2e,
                                text_bytes, tokens))
                t0 = time.perf_counter()
                ray.init(num_cpus=args.num_cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
                notes["ray_init_s"] = round(time.perf_counter() - t0, 3)
                cold = prepare_once(corpus, tmp / "out", tok_path, args.seq_len)
                rows.append(row(f"{label}: prepare, cold (first run on a fresh Ray, {args.num_cpus} CPUs)",
                                cold["elapsed_s"], text_bytes, tokens))
            warm = min((prepare_once(corpus, tmp / "out", tok_path, args.seq_len) for _ in range(args.repeats)),
                       key=lambda st: st["elapsed_s"])
            rows.append(row(f"{label}: prepare, warm ({args.num_cpus} CPUs)", warm["elapsed_s"], text_bytes * scale,
                            tokens * scale))
            rows[-1]["driver_cpu_s"] = round(warm["driver_cpu_s"], 3)
        for r in rows:
            base = next(b for b in rows if b["name"].split(":")[0] == r["name"].split(":")[0])
            r["vs_encode_batch_all_cores"] = round(r["mb_per_s"] / base["mb_per_s"], 3)
        ray.shutdown()

    width = max(len(r["name"]) for r in rows)
    print(f"{'':{width}}  {'seconds':>8}  {'MB/s':>7}  {'tokens/s':>10}  {'x baseline':>10}")
    for r in rows:
        print(f"{r['name']:{width}}  {r['seconds']:8.3f}  {r['mb_per_s']:7.2f}  {r['tokens_per_s']:10,}  "
              f"{r['vs_encode_batch_all_cores']:10.2f}")
    for k, v in notes.items():
        print(f"{k}: {v}")
    result = {
        "rows": rows, "notes": notes,
        "corpus": {"documents": info["documents"], "text_bytes": text_bytes, "tokens": tokens, "scale": args.scale},
        "machine": {"cpus": os.cpu_count(), "num_cpus_ray": args.num_cpus, "python": platform.python_version(),
                    "platform": platform.platform(), "loadavg_at_end": os.getloadavg()},
        "versions": versions(),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


def versions() -> dict:
    import pyarrow
    import ray
    import tokenizers

    return {"ray": ray.__version__, "tokenizers": tokenizers.__version__, "pyarrow": pyarrow.__version__}


if __name__ == "__main__":
    sys.exit(main())
