"""Held-out bits per byte: MiniMind's pretraining loop, re-implemented here, against minilm's loop (offline).

`python -m bench.minimind --minimind DIR` runs MiniMind's own script instead, and is the reference
bench/RESULTS.md quotes; this re-implementation is the fallback when no MiniMind checkout is at hand,
and the place for ablations of single choices.

    python -m bench.quality                              # demo corpus: reference vs minilm defaults (a few minutes)
    python -m bench.quality --runs reference,minilm,best # add minilm with its best options
    python -m bench.quality --runs ablation              # every single difference switched (bench/RESULTS.md)
    python -m bench.quality --input corpus.jsonl         # another corpus: JSONL or parquet with a "text" field

Both loops train the same model (same config, same initial weights), with the same tokens per
optimizer step (batch x (seq_len + 1) positions) and the same number of steps, on the same
training documents, and are scored on the same held-out documents in bits per byte
(`minilm.bpb.evaluate_documents`: every document read from its start in sliding windows).

* **reference**: MiniMind's `trainer/train_pretrain.py` as its public code makes its choices. One
  document per row, `[BOS] + doc[:L-2] + [EOS]` padded to L = seq_len + 1 with the padding masked
  out of the loss; rows in a seeded random order; `torch.optim.AdamW(model.parameters(), lr)` with
  torch's defaults (betas 0.9/0.999, weight decay 0.01 on every parameter); no warmup; its cosine
  `lr * (0.1 + 0.45 * (1 + cos(pi * t / T)))` for t = 1..T; clip 1.0; its initialisation (the HF
  `post_init`: normal(0, 0.02) for every Linear and the tied embedding, norms 1, which is also
  minilm's). The loop is written here (MiniMind is not a dependency).
* **minilm**: `minilm.train.train` with `TrainConfig`'s defaults on minilm's default rows
  (`minilm.rows.best_fit_rows`, what `ray_jobs.prepare` writes).
* **best**: `minilm.train.train` with minilm's options beyond its defaults on the same rows
  (document-masked attention, Muon).
* **ablation**: the reference with one of its choices switched to minilm's (or to an option) at a time.

The tokenizer is a byte-level BPE trained on the training documents (`minilm.tokenizer`); the
held-out documents are a seeded random `--held-out` share of the corpus. Each document is scored
the way the model is used: from its start, after a BOS. Special-token targets are not scored (they
spell no text). Writes quality.json to bench/results/ (or $MINILM_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from minilm.bpb import evaluate_documents, token_byte_lengths
from minilm.config import ModelConfig, TrainConfig
from minilm.corpus import demo_corpus_documents
from minilm.model import MiniMindForCausalLM
from minilm.rows import best_fit_rows, bos_aligned_rows, packed_rows, padded_document_rows
from minilm.schedule import get_lr
from minilm.step import TORCH_DTYPES, autocast, make_grad_scaler, make_optimizer, optimizer_step, set_lr
from minilm.tokenizer import BOS_ID, EOS_ID, save_tokenizer, train_tokenizer, vocab_size_of
from minilm.train import train as minilm_train

from .common import alternate, environment, load_average, write_json

DTYPES = ("fp32", "bf16")  # the autocast dtypes of both loops


class InputError(ValueError):
    """The --input corpus cannot be read."""


@dataclass(frozen=True)
class Recipe:
    """One training loop of the ablation; the defaults are MiniMind's choices."""

    rows: str = "padded"  # padded | packed | packed-bos | bos-aligned | best-fit (minilm)
    document_mask: bool = False
    decay: str = "all"  # all: AdamW(model.parameters()); matrices: minilm's groups (no decay on norm gains)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.01
    warmup_steps: int = 0
    schedule: str = "minimind"  # minimind: get_lr(t) for t = 1..T; minilm: minilm.schedule.get_lr(step 0..T-1)
    optimizer: str = "adamw"  # adamw | muon


REFERENCE = Recipe()
# What each ablation row switches, one at a time, from the reference (minilm's choice or an option).
ABLATION = {
    "reference": REFERENCE,
    "rows: packed": dataclasses.replace(REFERENCE, rows="packed"),
    "rows: packed + BOS": dataclasses.replace(REFERENCE, rows="packed-bos"),
    "rows: packed + BOS + doc mask": dataclasses.replace(REFERENCE, rows="packed-bos", document_mask=True),
    "rows: BOS-aligned best-fit": dataclasses.replace(REFERENCE, rows="bos-aligned"),
    "rows: BOS-aligned + doc mask": dataclasses.replace(REFERENCE, rows="bos-aligned", document_mask=True),
    "rows: best-fit (minilm)": dataclasses.replace(REFERENCE, rows="best-fit"),
    "betas 0.9/0.95 (minilm)": dataclasses.replace(REFERENCE, betas=(0.9, 0.95)),
    "weight decay 0.1 (minilm)": dataclasses.replace(REFERENCE, weight_decay=0.1),
    "decay matrices only (minilm)": dataclasses.replace(REFERENCE, decay="matrices"),
    "warmup 20 steps": dataclasses.replace(REFERENCE, warmup_steps=20, schedule="minilm"),
    "muon": dataclasses.replace(REFERENCE, optimizer="muon", decay="matrices"),
}


def read_corpus(paths: list[str]) -> list[str]:
    """Documents of JSONL ({"text": ...} per line) or parquet (a "text" column) files, in order."""
    docs: list[str] = []
    for path in map(Path, paths):
        if not path.is_file():
            raise InputError(f"--input {path}: file not found")
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq

            try:
                table = pq.read_table(path, columns=["text"])
            except Exception as e:  # pyarrow raises several types for a bad or foreign file
                raise InputError(f"--input {path}: not a parquet file with a 'text' column ({e})") from None
            docs.extend(t for t in table.column("text").to_pylist() if isinstance(t, str) and t.strip())
            continue
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    raise InputError(f"--input {path}:{n}: not a JSON object with a \"text\" field") from None
                if isinstance(text, str) and text.strip():
                    docs.append(text)
    if not docs:
        raise InputError(f"--input {' '.join(paths)}: no documents with text")
    return docs


def split(docs: list[str], held_out: float, seed: int) -> tuple[list[str], list[str]]:
    order = np.random.default_rng(seed).permutation(len(docs))
    n_held = max(1, round(len(docs) * held_out))
    return [docs[i] for i in sorted(order[n_held:])], [docs[i] for i in sorted(order[:n_held])]


def minimind_lr(t: int, total: int, lr: float) -> float:
    """MiniMind's trainer_utils.get_lr, called with t = 1..total."""
    return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t / total)))


def build_rows(layout: str, docs: list[list[int]], row_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, labels) of one layout; labels are -100 where there is no target (padding)."""
    if layout == "padded":
        rows, labels = padded_document_rows(docs, row_len)
        return torch.as_tensor(rows), torch.as_tensor(labels)
    if layout == "packed":
        rows, _ = packed_rows(docs, row_len)
    elif layout == "packed-bos":
        rows, _ = packed_rows(docs, row_len, bos_id=BOS_ID)
    elif layout == "bos-aligned":
        rows, _ = bos_aligned_rows(docs, row_len)
    elif layout == "best-fit":
        rows, _ = best_fit_rows(docs, row_len)
    else:
        raise ValueError(f"unknown row layout {layout!r}")
    rows = torch.as_tensor(rows.astype(np.int64))
    return rows, rows


def batch_order(n_rows: int, rows_needed: int, seed: int) -> torch.Tensor:
    """MiniMind's order: a fresh torch.randperm per epoch (seeded with seed + epoch), as many epochs as needed."""
    parts, epoch = [], 0
    while sum(len(p) for p in parts) < rows_needed:
        torch.manual_seed(seed + epoch)
        parts.append(torch.randperm(n_rows))
        epoch += 1
    return torch.cat(parts)[:rows_needed]


def train_recipe(recipe: Recipe, model_cfg: ModelConfig, docs: list[list[int]], args) -> tuple[MiniMindForCausalLM, dict]:
    """The ablation's loop: one optimizer step per batch, the choices of `recipe`."""
    rows, labels = build_rows(recipe.rows, docs, args.seq_len + 1)
    torch.manual_seed(args.seed)
    model = MiniMindForCausalLM(dataclasses.replace(model_cfg, document_mask=recipe.document_mask)).train()
    if recipe.decay == "all" and recipe.optimizer == "adamw":
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=recipe.betas,
                                      weight_decay=recipe.weight_decay)
    else:
        optimizer = make_optimizer(model, TrainConfig(lr=args.lr, betas=recipe.betas, weight_decay=recipe.weight_decay,
                                                      optimizer=recipe.optimizer))
    order = batch_order(len(rows), args.steps * args.batch_size, args.seed)
    dtype = TORCH_DTYPES[args.dtype]
    t0 = time.perf_counter()
    for step in range(args.steps):
        if recipe.schedule == "minimind":
            lr = minimind_lr(step + 1, args.steps, args.lr)
        else:
            lr = get_lr(step, args.steps, args.lr, recipe.warmup_steps)
        set_lr(optimizer, lr)
        idx = order[step * args.batch_size:(step + 1) * args.batch_size]
        with autocast("cpu", dtype):
            out = model(rows[idx][:, :-1], targets=labels[idx][:, 1:])  # seq_len positions, as the training step
        (out.loss + out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    wall = time.perf_counter() - t0
    targets = labels[order][:, 1:]
    return model, {"train_s": wall, "text_targets": int((targets > EOS_ID).sum()), "num_rows": len(rows),
                   "final_loss": float(out.loss.detach())}


def train_minilm(model_cfg: ModelConfig, train_cfg: TrainConfig, rows: np.ndarray) -> tuple[MiniMindForCausalLM, dict]:
    """minilm's own loop, `minilm.train.train`, on `rows` (the layout its options ask for)."""
    sequences = torch.as_tensor(rows.astype(np.int64))
    t0 = time.perf_counter()
    model, history = minilm_train(model_cfg, train_cfg, sequences, device="cpu", log=lambda _: None)
    wall = time.perf_counter() - t0
    # Rows are sampled without padding, so text targets ~ rows trained x the layout's share of text targets.
    trained = train_cfg.max_steps * train_cfg.global_batch_size
    return model, {"train_s": wall, "num_rows": len(rows), "final_loss": history[-1]["loss"],
                   "text_targets": round(trained * (rows.shape[1] - 1) * float((rows[:, 1:] > EOS_ID).mean()))}


def minilm_configs(args, model_cfg: ModelConfig, best: bool) -> tuple[ModelConfig, TrainConfig]:
    train_cfg = TrainConfig(lr=args.lr, max_steps=args.steps, micro_batch_size=args.batch_size,
                            global_batch_size=args.batch_size, seq_len=args.seq_len, dtype=args.dtype, seed=args.seed,
                            epochs=1_000, log_every=10_000)
    if best:
        train_cfg = dataclasses.replace(train_cfg, optimizer="muon")
        model_cfg = dataclasses.replace(model_cfg, document_mask=True)
    return model_cfg, train_cfg


def warm_up(model_cfg: ModelConfig, args) -> None:
    """Two untimed steps at the run's shapes: the first bf16 kernels of a process are compiled on first use."""
    torch.manual_seed(args.seed)
    model = MiniMindForCausalLM(model_cfg)
    ids = torch.randint(3, model_cfg.vocab_size, (args.batch_size, args.seq_len + 1))
    for _ in range(2):
        with autocast("cpu", TORCH_DTYPES[args.dtype]):
            model(ids[:, :-1], targets=ids[:, 1:]).loss.backward()


def step_times(model_cfg: ModelConfig, args, steps: int = 4) -> dict[str, float]:
    """Median optimizer step time of minilm's defaults and of its best options, alternating step by step.

    The quality runs follow each other, so their wall times drift with the machine's load; these
    steps take turns, so the ratio holds on a busy machine too.
    """
    scaler = make_grad_scaler(TORCH_DTYPES[args.dtype], "cpu")
    batch = torch.randint(3, model_cfg.vocab_size, (args.batch_size, args.seq_len + 1),
                          generator=torch.Generator().manual_seed(0))
    fns = {}
    for name, best in (("minilm", False), ("best", True)):
        cfg_m, cfg_t = minilm_configs(args, model_cfg, best)
        torch.manual_seed(args.seed)
        model = MiniMindForCausalLM(cfg_m).train()
        opt = make_optimizer(model, cfg_t)
        step = functools.partial(optimizer_step, model, opt, scaler, [batch], lr=args.lr, grad_clip=1.0,
                                 dtype=TORCH_DTYPES[args.dtype])
        fns[name] = lambda _i, step=step: step()
    times = alternate(fns, timed=steps, warmup=1)
    return {name: statistics.median(t) for name, t in times.items()}


def parse_runs(spec: str) -> list[str]:
    names: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if part == "ablation":
            names += [*ABLATION, "minilm", "best"]
        elif part in ("reference", "minilm", "best") or part in ABLATION:
            names.append(part)
        else:
            raise InputError(f"--runs: unknown run {part!r}; choose from reference, minilm, best, ablation, "
                             f"or an ablation row: {', '.join(ABLATION)}")
    return list(dict.fromkeys(names))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.quality", description=__doc__.split("\n")[0])
    p.add_argument("--input", nargs="+", help="JSONL ({\"text\": ...} per line) or parquet files; default: the demo corpus")
    p.add_argument("--max-docs", type=int, default=None, help="use at most this many documents of the corpus")
    p.add_argument("--runs", default="reference,minilm",
                   help="comma-separated: reference, minilm, best, ablation (all rows), or one ablation row")
    p.add_argument("--held-out", type=float, default=0.1, help="share of documents held out for bits per byte")
    p.add_argument("--vocab-size", type=int, default=6400)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-hidden-layers", type=int, default=4)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-key-value-heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="rows of seq_len + 1 tokens per optimizer step")
    p.add_argument("--steps", type=int, default=166, help="optimizer steps of every run")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="autocast dtype of both loops")
    p.add_argument("--eval-stride", type=int, default=None, help="sliding-window stride (default: seq_len / 2)")
    p.add_argument("--seed", type=int, default=42)
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.seq_len < 2 or not 0 < args.held_out < 1:
        p.error("--steps and --batch-size must be >= 1, --seq-len >= 2, --held-out in (0, 1)")
    try:
        runs = parse_runs(args.runs)
        texts = read_corpus(args.input) if args.input else list(demo_corpus_documents())
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.max_docs:
        texts = texts[: args.max_docs]
    train_texts, held_texts = split(texts, args.held_out, args.seed)
    tok = train_tokenizer(train_texts, args.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        byte_lengths = token_byte_lengths(save_tokenizer(tok, Path(tmp) / "tokenizer.json"))
    train_docs = [e.ids for e in tok.encode_batch_fast(train_texts, add_special_tokens=False)]
    held_docs = [e.ids for e in tok.encode_batch_fast(held_texts, add_special_tokens=False)]
    model_cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                            num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                            vocab_size=vocab_size_of(tok), max_position_embeddings=args.seq_len + 1)
    train_tokens = sum(map(len, train_docs))
    print(f"corpus: {len(texts):,} documents ({'demo' if not args.input else ', '.join(args.input)}); "
          f"train {len(train_docs):,} documents, {train_tokens:,} tokens (median {int(np.median([len(d) for d in train_docs]))} "
          f"per document); held out {len(held_docs):,} documents, {sum(map(len, held_docs)):,} tokens, "
          f"{sum(len(t.encode()) for t in held_texts):,} bytes")
    print(f"model: hidden {args.hidden_size}, {args.num_hidden_layers} layers, vocab {model_cfg.vocab_size}; "
          f"{args.steps} steps of {args.batch_size} x {args.seq_len + 1} tokens, lr {args.lr}, {args.dtype}; "
          f"load {load_average()}", flush=True)

    warm_up(model_cfg, args)
    results = []
    for name in runs:
        if name in ABLATION:
            recipe = ABLATION[name]
            model, info = train_recipe(recipe, model_cfg, train_docs, args)
            layout = recipe.rows
        else:
            layout = "best-fit"
            cfg_m, cfg_t = minilm_configs(args, model_cfg, name == "best")
            model, info = train_minilm(cfg_m, cfg_t, best_fit_rows(train_docs, args.seq_len + 1)[0])
        t0 = time.perf_counter()
        score = evaluate_documents(model, held_docs, byte_lengths, prefix=[BOS_ID], window=args.seq_len + 1,
                                   stride=args.eval_stride or args.seq_len // 2, autocast_dtype=TORCH_DTYPES[args.dtype])
        results.append({"run": name, "rows": layout, **info, "eval_s": time.perf_counter() - t0, **score,
                        "load": load_average()})
        print(f"  {name:32s} bpb {score['bpb']:.4f}  train {info['train_s']:6.1f} s  load {load_average()}",
              flush=True)
    print_table(results)
    timing = None
    if "best" in runs:
        timing = step_times(model_cfg, args)
        print(f"optimizer step, alternating (median of 4, load {load_average()}): minilm {timing['minilm']:.3f} s, "
              f"best {timing['best']:.3f} s, best / minilm {timing['best'] / timing['minilm']:.2f}x")
    write_json("quality.json", {"environment": environment(), "args": vars(args), "results": results,
                                "step_times": timing})
    return 0


def print_table(results: list[dict]) -> None:
    ref = next((r for r in results if r["run"] == "reference"), None)
    print(f"\n{'run':32s} {'rows':12s} {'bpb':>7s} {'/ ref':>7s} {'train s':>8s} {'text targets':>13s}")
    for r in results:
        ratio = f"{r['bpb'] / ref['bpb']:.4f}" if ref else "-"
        print(f"{r['run']:32s} {r['rows']:12s} {r['bpb']:7.4f} {ratio:>7s} {r['train_s']:8.1f} {r['text_targets']:13,}")
    if ref:
        for r in results:
            if r["run"] in ("minilm", "best"):
                print(f"{r['run']} / reference: bits per byte {r['bpb'] / ref['bpb']:.4f}x, "
                      f"train wall time {r['train_s'] / ref['train_s']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
