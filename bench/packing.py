"""Useful tokens per second: packed rows vs MiniMind-style padded rows built from the same documents.

    python -m bench.packing                        # demo preset model (hidden 256, 4 layers), seq 256, fp32
    python -m bench.packing --seq-len 512 --dtype bf16

The documents are the first `--corpus-kb` of the built-in demo corpus (`minilm.corpus`: stdlib
docstrings), tokenized with a byte-level BPE trained on them (`minilm.tokenizer`). From the same
documents, in the same order, it builds

* packed rows (`minilm.rows.pack_documents`, what `ray_jobs.prepare` writes): every document
  followed by EOS, concatenated, cut into rows of seq_len + 1; every position has a target;
* padded rows, as MiniMind's pretraining loop builds them: one row per document, BOS + text + EOS,
  truncated to seq_len + 1 and padded with PAD; padded targets are masked out of the loss (label
  -100, MiniMind's loss_mask), and what truncation cuts off is never trained on.

Then it times the same optimizer step (forward, backward, clip, AdamW) on micro-batches of each,
alternating, and reports useful (non-pad target) tokens per second. Writes packing.json to
bench/results/ (or $MINILM_BENCH_RESULTS).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

from minilm.config import ModelConfig, TrainConfig
from minilm.corpus import demo_corpus_documents
from minilm.model import MiniMindForCausalLM
from minilm.rows import pack_documents
from minilm.step import TORCH_DTYPES, autocast, make_optimizer
from minilm.tokenizer import BOS_ID, EOS_ID, PAD_ID, train_tokenizer

from .common import alternate, environment, write_json

DTYPES = ("fp32", "bf16")  # the autocast dtypes this benchmark compares


def padded_rows(docs: list[list[int]], seq_len: int) -> tuple[np.ndarray, int]:
    """(rows, tokens cut off by truncation): MiniMind's BOS + doc + EOS, truncated, PAD-filled to seq_len + 1."""
    rows = np.full((len(docs), seq_len + 1), PAD_ID, dtype=np.int64)
    cut = 0
    for i, doc in enumerate(docs):
        ids = [BOS_ID, *doc, EOS_ID]
        cut += max(0, len(ids) - (seq_len + 1))
        ids = ids[: seq_len + 1]
        rows[i, : len(ids)] = ids
    return rows, cut


def labels_for(rows: torch.Tensor, padded: bool) -> torch.Tensor:
    """The model shifts labels by one inside; PAD targets of padded rows are ignored (label -100).

    Packed rows hold EOS (id 2) but never PAD (id 0): no document token is PAD, so nothing is masked.
    """
    return rows.masked_fill(rows == PAD_ID, -100) if padded else rows


def useful_targets(labels: torch.Tensor) -> int:
    """Positions 1.. of each row that carry a target (position t predicts token t + 1)."""
    return int((labels[:, 1:] != -100).sum())


def make_step(model, optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype):
    """One optimizer step on micro-batch i, the same code for both layouts (MiniMind's masked mean loss)."""
    def step(i: int) -> None:
        ids, labels = batches[i]
        with autocast("cpu", dtype):
            out = model(ids[:, :-1], targets=labels[:, 1:])  # seq_len positions fed and scored, as the step does
        (out.loss + out.aux_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(out.loss.detach())
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.packing", description=__doc__.split("\n")[0])
    p.add_argument("--corpus-kb", type=int, default=512, help="KB of demo-corpus text to use")
    p.add_argument("--vocab-size", type=int, default=6400)
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--num-hidden-layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=6, help="timed optimizer steps per layout")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")

    texts = list(demo_corpus_documents(max_bytes=args.corpus_kb << 10))
    tok = train_tokenizer(texts, args.vocab_size)
    docs = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    doc_tokens = sum(len(d) for d in docs)
    packed, dropped_tail = pack_documents(docs, args.seq_len, eos_id=EOS_ID)
    padded, truncated = padded_rows(docs, args.seq_len)
    layouts = {"packed": torch.as_tensor(packed.astype(np.int64)), "padded": torch.as_tensor(padded)}
    n_steps = args.warmup + args.steps
    for name, rows in layouts.items():
        if len(rows) < n_steps * args.micro_batch_size:
            p.error(f"{name}: {len(rows)} rows do not fill {n_steps} micro-batches of {args.micro_batch_size}; "
                    f"raise --corpus-kb or lower --steps")

    # Whole-corpus facts: what share of each layout's target positions is a real token.
    corpus = {}
    for name, rows in layouts.items():
        labels = labels_for(rows, padded=name == "padded")
        corpus[name] = {"rows": len(rows), "target_positions": rows.shape[0] * args.seq_len,
                        "useful_targets": useful_targets(labels)}
        corpus[name]["useful_fraction"] = corpus[name]["useful_targets"] / corpus[name]["target_positions"]

    dtype = TORCH_DTYPES[args.dtype]
    cfg = ModelConfig(hidden_size=args.hidden_size, num_hidden_layers=args.num_hidden_layers,
                      vocab_size=max(args.vocab_size, tok.get_vocab_size()), max_position_embeddings=args.seq_len + 1)
    steps, batches = {}, {}
    for name, rows in layouts.items():
        torch.manual_seed(0)  # the same initial weights for both layouts
        model = MiniMindForCausalLM(cfg).train()
        # Micro-batches from the start of the corpus in document order, as an epoch would take them.
        batches[name] = [(b, labels_for(b, padded=name == "padded"))
                         for b in rows[: n_steps * args.micro_batch_size].split(args.micro_batch_size)]
        steps[name] = make_step(model, make_optimizer(model, TrainConfig(optimizer="adamw", lr=1e-4)), batches[name], dtype)
    times = alternate(steps, args.steps, args.warmup)

    rows_out = {}
    for name in layouts:
        timed = batches[name][args.warmup:]
        useful = sum(useful_targets(labels) for _, labels in timed)
        positions = sum(labels.shape[0] * args.seq_len for _, labels in timed)
        seconds = sum(times[name])
        rows_out[name] = {"step_s_mean": seconds / len(times[name]), "step_s_all": times[name],
                          "target_positions_per_s": positions / seconds, "useful_tokens_per_s": useful / seconds,
                          "useful_fraction_timed": useful / positions, **{f"corpus_{k}": v for k, v in corpus[name].items()}}
    ratio = rows_out["packed"]["useful_tokens_per_s"] / rows_out["padded"]["useful_tokens_per_s"]
    # The same ratio over a whole epoch of this corpus: useful targets per second of (rows x step time per row).
    epoch_ratio = (corpus["packed"]["useful_targets"] / (corpus["packed"]["rows"] * rows_out["packed"]["step_s_mean"])) \
        / (corpus["padded"]["useful_targets"] / (corpus["padded"]["rows"] * rows_out["padded"]["step_s_mean"]))

    env = environment()
    print(f"# {env['cpu']}, {env['torch_threads']} torch threads, torch {env['torch']}, "
          f"load average {env['load_average']}")
    print(f"# corpus: {len(docs):,} documents, {doc_tokens:,} tokens (median {int(np.median([len(d) for d in docs]))} "
          f"per document), vocab {tok.get_vocab_size()}; model hidden {args.hidden_size}, layers "
          f"{args.num_hidden_layers}, seq {args.seq_len}, micro-batch {args.micro_batch_size}, {args.dtype}; "
          f"{args.steps} timed steps per layout after {args.warmup} warm-up, alternating")
    print(f"packed: {corpus['packed']['rows']:,} rows, {dropped_tail} tail tokens dropped; padded: "
          f"{corpus['padded']['rows']:,} rows, {truncated:,} tokens ({truncated / doc_tokens:.1%} of the corpus) "
          f"cut off by truncation")
    header = f"{'layout':<8} {'step s':>7} {'positions/s':>12} {'useful/s':>10} {'useful (timed)':>15} {'useful (corpus)':>16}"
    print(header)
    print("-" * len(header))
    for name, r in rows_out.items():
        print(f"{name:<8} {r['step_s_mean']:>7.3f} {r['target_positions_per_s']:>12,.0f} {r['useful_tokens_per_s']:>10,.0f} "
              f"{r['useful_fraction_timed']:>15.1%} {r['corpus_useful_fraction']:>16.1%}")
    print(f"packed / padded useful tokens per second: {ratio:.2f}x on the timed steps, {epoch_ratio:.2f}x over an "
          f"epoch of this corpus")
    path = write_json("packing.json", {"args": vars(args), "environment": env, "documents": len(docs),
                                       "document_tokens": doc_tokens, "truncated_tokens": truncated,
                                       "dropped_tail_tokens": int(dropped_tail), "layouts": rows_out,
                                       "packed_over_padded": ratio, "packed_over_padded_epoch": epoch_ratio})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
