"""Held-out quality against MiniMind's own `trainer/train_pretrain.py`, run beside minilm on the same documents
on four corpora: the built-in demo corpus, the King James Bible as passages and as chapters (Debian's bible-kjv, or
--kjv FILE), and Chinese fortunes (Debian's fortunes-zh). bench/README.md has the details. Writes minimind.json."""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from minilm.bpb import evaluate_documents, token_byte_lengths
from minilm.config import ModelConfig
from minilm.corpus import demo_corpus_documents
from minilm.model import MiniMindForCausalLM
from minilm.tokenizer import BOS_ID

from .common import add_model_args, environment, load_average, table, write_json

# ---- the corpora and their seeded held-out split -------------------------------------------------------------

CORPORA = ("demo", "kjv-passages", "kjv-chapters", "zh-fortunes")
ZH_FORTUNES = Path("/usr/share/games/fortunes")  # Debian's fortunes-zh (GPL-3.0+)
ZH_FILES = ("chinese", "tang300", "song100")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
KJV_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")
PASSAGE_CHARS = 900
CHAPTERS_PER_DOC = 3


class BenchError(ValueError):
    """A bad flag, a missing checkout or corpus, or a run that failed: one line, exit 2."""


def kjv_chapters(kjv_file: str | None) -> list[tuple[str, list[str]]]:
    """[(book, [verse text, ...]) per chapter] of the KJV, in order."""
    if kjv_file:
        text = Path(kjv_file).read_text(encoding="utf-8")
    elif shutil.which("bible"):
        text = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    else:
        raise BenchError("the kjv corpora need Debian's bible-kjv (apt-get install bible-kjv) or --kjv FILE")
    chapters: dict[tuple[str, str], list[str]] = {}
    for m in filter(None, map(KJV_VERSE.match, map(str.strip, text.splitlines()))):
        chapters.setdefault((m.group(1), m.group(2)), []).append(m.group(4).strip())
    if len(chapters) < 100:
        raise BenchError(f"--kjv: found {len(chapters)} chapters, expected the whole KJV (1,189)")
    return [(book, verses) for (book, _), verses in chapters.items()]


def zh_fortunes(folder: Path = ZH_FORTUNES) -> list[str]:
    """Debian's fortunes-zh: Chinese prose (quotations, essays, jokes, Debian's code of conduct), the 300 Tang poems
    and 100 Song lyrics, one document per fortune (a few characters to ~9,000), colour escapes removed."""
    if not all((folder / f).is_file() for f in ZH_FILES):
        raise BenchError("the zh-fortunes corpus needs Debian's fortunes-zh (apt-get install fortunes-zh)")
    parts = [ANSI.sub("", part).strip() for name in ZH_FILES
             for part in (folder / name).read_text(encoding="utf-8", errors="replace").split("\n%\n")]
    return [text for text in parts if len(text) >= 8]


def corpus_documents(name: str, kjv_file: str | None) -> list[str]:
    if name == "demo":
        return list(demo_corpus_documents())
    if name == "zh-fortunes":
        return zh_fortunes()
    if name not in CORPORA:
        raise BenchError(f"--corpus: unknown corpus {name!r}; choose from {', '.join(CORPORA)}")
    docs, group, book = [], [], None
    for b, verses in kjv_chapters(kjv_file):
        if name == "kjv-passages":  # consecutive verses of a chapter, closed once PASSAGE_CHARS is reached
            for i, v in enumerate(verses, 1):
                group.append(v)
                if sum(map(len, group)) >= PASSAGE_CHARS or i == len(verses):
                    docs.append(" ".join(group))
                    group = []
            continue
        if group and (b != book or len(group) == CHAPTERS_PER_DOC):  # kjv-chapters: a few chapters of one book
            docs.append("\n\n".join(group))
            group = []
        book = b
        group.append(" ".join(verses))
    return docs + (["\n\n".join(group)] if group else [])


@dataclass
class Split:
    train: list[str]
    held_out: list[str]
    epochs: int  # MiniMind's --epochs that make `steps` optimizer steps over `train`
    steps: int


def split_corpus(docs: list[str], steps: int, batch_size: int, held_out: int, seed: int) -> Split:
    """A seeded held-out set, then the training documents for `steps` MiniMind steps (whole epochs of whole batches)."""
    order = np.random.default_rng(seed).permutation(len(docs))
    held_out = min(held_out, len(docs) // 5)
    available = len(docs) - held_out
    epochs = max(1, math.ceil(steps * batch_size / available))
    n_train = max(1, steps // epochs) * batch_size
    if n_train > available:
        raise BenchError(f"{len(docs)} documents are too few for {steps} steps of {batch_size}")
    return Split([docs[i] for i in sorted(order[held_out:held_out + n_train])],
                 [docs[i] for i in sorted(order[:held_out])], epochs, epochs * max(1, steps // epochs))


# ---- the runs ---------------------------------------------------------------------------------------------------

@dataclass
class Result:
    corpus: str
    seed: int
    run: str
    steps: int
    real_tokens: int  # training targets that are not padding (both loops score every one of them)
    train_s: float
    ce: float = float("nan")
    bpb: float = float("nan")
    curve: list | None = None  # [(step, seconds since the command started, ce)] of the checkpoints along the run
    to_minimind_s: float | None = None  # when the curve first reaches MiniMind's final CE (None: never)


def run_logged(cmd: list[str], cwd: Path, log: Path, env: dict | None = None) -> float:
    """Run `cmd`, its output to `log`; the wall time. A failure is one BenchError naming the log."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    if proc.returncode:
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        raise BenchError(f"{shlex.join(cmd[:4])}... exited {proc.returncode} (log {log}): {tail[0][:300]}")
    return time.perf_counter() - t0


def minimind_copy(checkout: Path, work: Path) -> Path:
    """MiniMind's model/, dataset/ and trainer/ copied under `work` (its script writes ../out, ../checkpoints)."""
    for part in ("model", "dataset", "trainer"):
        if not (checkout / part).is_dir():
            raise BenchError(f"--minimind {checkout}: no {part}/ folder: not a MiniMind checkout")
    if not (checkout / "trainer" / "train_pretrain.py").is_file():
        raise BenchError(f"--minimind {checkout}: no trainer/train_pretrain.py")
    dest = work / "minimind"
    if not dest.exists():
        for part in ("model", "dataset", "trainer"):
            shutil.copytree(checkout / part, dest / part)
    return dest


def run_minimind(mm: Path, train_jsonl: Path, split: Split, args, seed: int, log: Path,
                 env: dict) -> tuple[dict, float]:
    """MiniMind's train_pretrain.py on `train_jsonl`: its final fp32 weights and wall seconds, kept beside the log
    keyed by the script's arguments for later invocations to reuse (`--no-reuse` trains it again)."""
    key = {"epochs": split.epochs, "batch_size": args.batch_size, "lr": args.lr, "hidden_size": args.hidden_size,
           "num_hidden_layers": args.num_hidden_layers, "max_seq_len": args.seq_len + 1, "seed": seed,
           "train_sha256": hashlib.sha256(train_jsonl.read_bytes()).hexdigest()}
    cached = log.with_name(f"minimind-h{args.hidden_size}x{args.num_hidden_layers}.json")
    if args.reuse and cached.is_file() and json.loads(cached.read_text())["key"] == key:
        print(f"  (MiniMind's run reused from {cached})", flush=True)
        return load_file(str(cached.with_suffix(".safetensors"))), json.loads(cached.read_text())["wall_s"]
    for old in ("out", "checkpoints"):
        shutil.rmtree(mm / old, ignore_errors=True)
    script_args = ["--epochs", str(split.epochs), "--batch_size", str(args.batch_size),
                   "--learning_rate", str(args.lr), "--device", "cpu", "--dtype", "float32",
                   "--num_workers", "0", "--accumulation_steps", "1", "--grad_clip", "1.0",
                   "--log_interval", "20", "--save_interval", str(10 ** 9),
                   "--hidden_size", str(args.hidden_size), "--num_hidden_layers", str(args.num_hidden_layers),
                   "--max_seq_len", str(args.seq_len + 1), "--data_path", str(train_jsonl)]
    # MiniMind fixes its seed at 42: for another, shift its setup_seed and run the same script
    code = ("import runpy, sys; sys.path.insert(0, '..'); import trainer.trainer_utils as u; f = u.setup_seed; "
            f"u.setup_seed = lambda s: f(s + {seed - 42}); sys.argv = ['train_pretrain.py'] + sys.argv[1:]; "
            "runpy.run_path('train_pretrain.py', run_name='__main__')")
    cmd = [sys.executable, *(["train_pretrain.py"] if seed == 42 else ["-c", code]), *script_args]
    wall = run_logged(cmd, mm / "trainer", log, env={"TOKENIZERS_PARALLELISM": "false", **env})
    weights = mm / "out" / f"pretrain_{args.hidden_size}.pth"
    if not weights.is_file():
        raise BenchError(f"MiniMind wrote no {weights} (log {log})")
    state = torch.load(weights, map_location="cpu", weights_only=True)
    state = {k: v.float().contiguous() for k, v in state.items() if k != "lm_head.weight"}  # tied: one copy
    save_file(state, str(cached.with_suffix(".safetensors")))
    cached.write_text(json.dumps({"key": key, "wall_s": wall}))
    return state, wall


def split_flags(flags: list[str]) -> tuple[list[str], list[str]]:
    """(prepare flags, train flags) of a `minilm --flag value ...` run name: --rows goes to prepare."""
    rows = [i for i, f in enumerate(flags) if f == "--rows"]
    prep = [f for i in rows for f in flags[i:i + 2]]
    return prep, [f for i, f in enumerate(flags) if not any(i in (r, r + 1) for r in rows)]


def run_minilm(data: Path, flags: list[str], steps: int, seed: int, args, run_dir: Path, env: dict,
               curve: int = 0, ray: bool = False) -> tuple[dict, float, list]:
    """`python -m minilm.train` (`ray`: the 1-worker Ray job) on `data`; (its final fp32 weights, wall seconds,
    [(step, seconds since the command started, checkpoint)] of `curve` checkpoints along the run)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    every = max(1, steps // curve) if curve else steps
    launch = ["ray_jobs.pretrain", "--num-workers", "1", "--cpus-per-worker", str(args.threads)] if ray else ["minilm.train"]
    cmd = [sys.executable, "-m", *launch, "--data", str(data), "--run-dir", str(run_dir),
           "--hidden-size", str(args.hidden_size), "--num-hidden-layers", str(args.num_hidden_layers),
           "--seq-len", str(args.seq_len), "--vocab-size", str(ModelConfig.vocab_size),  # MiniMind's, not the data's
           "--micro-batch-size", str(args.batch_size), "--global-batch-size", str(args.batch_size), "--lr",
           str(args.lr), "--max-steps", str(steps), "--epochs", "1000", "--dtype", "fp32", "--seed", str(seed),
           "--checkpoint-every", str(every), "--keep-checkpoints", str(steps // every + 1), "--log-every",
           str(min(20, every)), *flags]
    started = time.time()
    wall = run_logged(cmd, Path.cwd(), run_dir / "train.log", env)
    checkpoints = sorted(run_dir.glob("checkpoint_*/model.safetensors"))
    if not checkpoints:
        raise BenchError(f"minilm wrote no checkpoint in {run_dir}")
    times = {r["optimizer_step"]: r["time"] - started for r in map(json.loads, (run_dir / "metrics.jsonl").open())}
    points = [(int(c.parent.name.split("_")[1]), c) for c in checkpoints]
    return load_file(str(checkpoints[-1])), wall, [(step, times[step], c) for step, c in points if step in times]


def time_to_reach(curve: list[tuple[int, float, float]], target: float) -> float | None:
    """When a [(step, seconds, ce)] curve first reaches `target`, linear between two checkpoints (None: never)."""
    before = None
    for _step, t, ce in curve:
        if ce <= target:
            if before is None:
                return t  # already at the first checkpoint: at most this
            t0, ce0 = before
            return t0 + (t - t0) * (ce0 - target) / (ce0 - ce)
        before = (t, ce)
    return None


def ce_at(curve: list[tuple[int, float, float]], seconds: float) -> float:
    """The CE of a [(step, seconds, ce)] curve at `seconds`, linear between checkpoints, its first or last outside."""
    return float(np.interp(seconds, [t for _, t, _ in curve], [ce for _, _, ce in curve]))


def score(state: dict, model_cfg: ModelConfig, held_docs: list[list[int]], byte_lengths: np.ndarray, args) -> dict:
    model = MiniMindForCausalLM(model_cfg)
    missing, _ = model.load_state_dict(state, strict=False)
    # MiniMind's state dict also holds the RoPE tables as buffers and the tied head; nothing trainable may be missing.
    trainable_missing = [k for k in missing if k != "lm_head.weight" or not model_cfg.tie_word_embeddings]
    if trainable_missing:
        raise BenchError(f"weights lack {trainable_missing[:3]}: not the same model config")
    with torch.no_grad():
        s = evaluate_documents(model, held_docs, byte_lengths, prefix=[BOS_ID], window=args.seq_len + 1,
                               stride=args.seq_len // 2)
    return {"ce": s["nats"] / s["tokens"], "bpb": s["bpb"]}


def real_tokens_minimind(train_docs: list[list[int]], epochs: int, row_len: int) -> int:
    """Targets MiniMind trains on: `[BOS] + doc[:row_len - 2] + [EOS]` has len - 1 targets, every epoch."""
    return epochs * sum(min(len(d), row_len - 2) + 1 for d in train_docs)


def record(r: Result, state: dict, results: list[Result], scorer, pool) -> None:
    """Score a finished run (and its curve's checkpoints, --parallel at a time, now that the round is over),
    append it to `results` and print its line; `scorer(state)` scores a state dict on the held-out documents."""
    r.__dict__.update(scorer(state))
    results.append(r)
    ref = next((x for x in results if x.run == "minimind"), None)
    if r.curve and ref:
        r.curve = list(pool.map(lambda point: (*point[:2], scorer(load_file(str(point[2])))["ce"]), r.curve))
        r.to_minimind_s = time_to_reach(r.curve, ref.ce)
        reached = (f"{r.to_minimind_s:.1f} s = {r.to_minimind_s / ref.train_s:.3f} x MiniMind's wall"
                   if r.to_minimind_s is not None else f"not within its {r.train_s:.0f} s")
        print(f"  {r.run} reaches MiniMind's final CE {ref.ce:.4f}: {reached}; curve " + ", ".join(
            f"{step}: {ce:.3f} @ {t:.0f} s" for step, t, ce in r.curve), flush=True)
    else:
        r.curve = None  # nothing to reach without MiniMind's run
    ratio = f"  ce / MiniMind {r.ce / ref.ce:.4f}  bpb / MiniMind {r.bpb / ref.bpb:.4f}" if ref else ""
    print(f"  {r.run:40s} steps {r.steps:4d}  tokens {r.real_tokens:9,}  train {r.train_s:6.1f} s"
          f"  ce {r.ce:.4f}  bpb {r.bpb:.4f}{ratio}  load {load_average()}", flush=True)


def bench_corpus(name: str, seed: int, runs: list[str], args, work: Path, checkout: Path) -> list[Result]:
    split = split_corpus(corpus_documents(name, args.kjv), args.steps, args.batch_size, args.held_out, seed)
    cwork = work / f"{name}-seed{seed}-h{args.hidden_size}x{args.num_hidden_layers}"
    mm = minimind_copy(checkout, work)
    tokenizer_file = mm / "model" / "tokenizer.json"
    byte_lengths = token_byte_lengths(tokenizer_file)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    cwork.mkdir(parents=True, exist_ok=True)
    train_jsonl = cwork / "train.jsonl"  # the training documents as the JSONL both loops read
    train_jsonl.write_text("".join(json.dumps({"text": t}) + "\n" for t in split.train))
    train_docs, held_docs = ([e.ids for e in tok.encode_batch(docs, add_special_tokens=False)]
                             for docs in (split.train, split.held_out))
    lengths = [len(d) for d in train_docs]
    print(f"\n== {name} (seed {seed}): {len(train_docs):,} training documents (median {int(np.median(lengths))} "
          f"tokens, {sum(lengths):,} in all), {len(held_docs):,} held out ({sum(map(len, held_docs)):,} tokens); "
          f"MiniMind: {split.epochs} epoch(s) = {split.steps} steps; load {load_average()}", flush=True)
    model_cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers)
    mm_tokens = real_tokens_minimind(train_docs, split.epochs, args.seq_len + 1)
    per_step, results, env = args.batch_size * args.seq_len, [], {"OMP_NUM_THREADS": str(args.threads)}

    def scorer(state: dict) -> dict:
        return score(state, model_cfg, held_docs, byte_lengths, args)

    def job(run: str, steps: int) -> tuple[Result, dict]:
        if run == "minimind":
            state, wall = run_minimind(mm, train_jsonl, split, args, seed, cwork / "minimind.log", env)
            return Result(name, seed, run, split.steps, mm_tokens, wall), state
        prep_flags, train_flags = split_flags(shlex.split(run)[1:])
        tag = re.sub(r"[^A-Za-z0-9]+", "-", run).strip("-")
        state, wall, points = run_minilm(prepared[tuple(prep_flags)], train_flags, steps, seed, args,
                                         cwork / f"run-{tag}", env, args.curve, ray=run.split()[0] == "ray")
        return Result(name, seed, run, steps, steps * per_step, wall, curve=points if args.curve else None), state

    # Runs go `--parallel` at a time (each with `--threads`), MiniMind's first, beside minilm's defaults: the
    # wall times of runs that ran side by side compare on a shared machine. One prepare at a time (each starts a
    # local Ray), before the runs.
    order = sorted(runs, key=lambda r: (r != "minimind", r != "minilm"))
    prepared = {}
    for flags in dict.fromkeys(tuple(split_flags(shlex.split(r)[1:])[0]) for r in order if r != "minimind"):
        out = cwork / ("tok" + "".join("-" + f.strip("-") for f in flags))
        if not (out / "manifest.json").is_file():
            run_logged([sys.executable, "-m", "ray_jobs.prepare", "--input", str(train_jsonl), "--output", str(out),
                        "--tokenizer", str(tokenizer_file), "--seq-len", str(args.seq_len), "--overwrite", *flags],
                       Path.cwd(), out.with_suffix(".log"))
        prepared[flags] = out
    with ThreadPoolExecutor(args.parallel) as pool:
        # Scored once the round is over: a score computed beside a run would slow that run alone.
        for r, state in list(pool.map(lambda run: job(run, split.steps), order)):
            record(r, state, results, scorer, pool)
    return results


def print_summary(results: list[Result]) -> None:
    """Per corpus, seed and minilm run against MiniMind: the CE ratio at equal steps and at equal wall time, and the
    wall time the run needs to reach MiniMind's final CE as a ratio of MiniMind's (every run's line came before)."""
    rows = []
    for mm in (r for r in results if r.run == "minimind"):
        for run in dict.fromkeys(r.run for r in results if r.run != "minimind"):
            steps = next(r for r in results if r.run == run and (r.corpus, r.seed) == (mm.corpus, mm.seed))
            # the curve at MiniMind's wall time (no credit for a schedule planned to end there)
            wall = ce_at([c for c in steps.curve if c[0] < steps.steps] + [(steps.steps, steps.train_s, steps.ce)],
                         mm.train_s) / mm.ce if steps.curve else None
            reach = steps.to_minimind_s
            rate = (steps.steps / steps.train_s) / (mm.steps / mm.train_s)  # both from their commands' wall
            rows.append([mm.corpus, mm.seed, run[:40], f"{rate:.3f}", f"{steps.ce / mm.ce:.4f}", "-" if wall is None else f"{wall:.4f}",
                         f"{reach / mm.train_s:.3f}" if reach is not None else f"> {steps.train_s / mm.train_s:.3f}"])
    print("\n" + table(["corpus", "seed", "run", "tokens/s / MM", "CE/MM equal steps", "CE/MM equal wall", "time to MM CE / MM wall"],
                       rows, left=3))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.minimind", description=__doc__)
    p.add_argument("--minimind", required=True, metavar="DIR", help="a checkout of github.com/jingyaogong/minimind")
    p.add_argument("--corpus", default=",".join(CORPORA), help=f"comma-separated, from {', '.join(CORPORA)}")
    p.add_argument("--kjv", metavar="FILE", help="the output of `bible -f \"Gen1:1-Rev22:21\"` (default: run it)")
    p.add_argument("--runs", default="minimind,minilm",
                   help="comma-separated: minimind, minilm (`minilm.train`), ray (the 1-worker Ray job), either "
                        "followed by its flags ('minilm --flag value ...')")
    p.add_argument("--seeds", default="42", help="comma-separated seeds (split, init, order)")
    p.add_argument("--reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse MiniMind's run of the same corpus, seed and settings from the work folder")
    p.add_argument("--curve", type=int, default=8, help="checkpoints along each minilm run, scored for the "
                                                        "time it needs to reach MiniMind's final CE (0: none)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads of every run")
    add_model_args(p, ("hidden_size", "num_hidden_layers", "seq_len"))
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=166, help="optimizer steps (MiniMind's whole epochs nearest it)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--held-out", type=int, default=200, help="held-out documents per corpus (at most a fifth)")
    p.add_argument("--work", metavar="DIR", default=None, help="work folder (default: bench/results/minimind-work)")
    args = p.parse_args(argv)
    try:
        checkout = Path(args.minimind).expanduser().resolve()
        if not checkout.is_dir():
            raise BenchError(f"--minimind {checkout}: no such folder")
        if args.curve < 0:
            raise BenchError(f"--curve must be >= 0 (checkpoints along minilm's run; 0: none), got {args.curve}")
        runs, corpora = ([x.strip() for x in flag.split(",") if x.strip()] for flag in (args.runs, args.corpus))
        for r in (r for r in runs if r != "minimind" and r.split()[0] not in ("minilm", "ray")):
            raise BenchError(f"--runs: {r!r}: a run is minimind, or minilm or ray followed by its flags")
        for c in (c for c in corpora if c not in CORPORA):
            raise BenchError(f"--corpus: unknown corpus {c!r}; choose from {', '.join(CORPORA)}")
        # Scoring uses --threads too: a score computed while another bench's run trains must not take its core.
        torch.set_num_threads(args.threads)
        work = Path(args.work) if args.work else Path(__file__).resolve().parent / "results" / "minimind-work"
        work.mkdir(parents=True, exist_ok=True)
        commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                                text=True).stdout.strip() or "unknown (not a git work tree)"
        print(f"MiniMind checkout {checkout} at {commit}; model hidden {args.hidden_size} x {args.num_hidden_layers} "
              f"layers, seq {args.seq_len}, batch {args.batch_size}, lr {args.lr}, fp32, {torch.get_num_threads()} "
              f"thread(s); load {load_average()}", flush=True)
        results = [r for seed in map(int, args.seeds.split(",")) for c in corpora
                   for r in bench_corpus(c, seed, runs, args, work, checkout)]
    except (BenchError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_summary(results)
    write_json("minimind.json", {"environment": environment(), "args": vars(args), "minimind_commit": commit,
                                 "results": [r.__dict__ for r in results]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
