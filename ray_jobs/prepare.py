"""Tokenize and pack a corpus into the prepared-data format of docs/data.md.

    python -m ray_jobs.prepare --input corpus/*.jsonl --output data/tok
    python -m ray_jobs.prepare --input books/ wiki.parquet --output data/tok --tokenizer tokenizer.json
    python -m ray_jobs.prepare --input corpus.jsonl --output data/tok --seq-len 512 --vocab-size 6400

Exit status: 0 done, 2 for any mistake in the flags or the inputs (the message says what and where),
1 when a Ray task fails, 130 when interrupted. The same inputs and options give the same token files.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from minilm.cli import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, ArgumentParser, UsageError, command, flag

from .prepare_inputs import RecordReader, SkipWarnings, resolve_inputs
from .prepare_pipeline import Progress, _si, tokenize_and_pack


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m ray_jobs.prepare",
        description="Tokenize and pack text into token files of seq_len+1 token rows (docs/data.md).",
        epilog="Inputs: .jsonl/.ndjson (one JSON object per line), .txt (one document per file), "
               ".parquet (one document per row), datasets save_to_disk folders; directories are walked "
               "recursively and globs expanded, in sorted order.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH",
                   help="files, directories or glob patterns, read in the order given")
    p.add_argument("--output", required=True, metavar="DIR", help="the prepared dataset to write")
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--tokenizer", metavar="PATH",
                     help="an existing tokenizer.json (or a folder holding one) with <|endoftext|>=0, "
                          "<|im_start|>=1, <|im_end|>=2 (default: a BPE trained on the input, --vocab-size)")
    tok.add_argument("--vocab-size", type=int, default=None, metavar="N",
                     help="train a byte-level BPE of N tokens on the input (default 6400)")
    p.add_argument("--seq-len", type=int, default=512, metavar="N",
                   help="tokens per training sequence; rows hold N+1 (default 512)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="JSON key / column holding the text (default: text)")
    p.add_argument("--on-bad-record", choices=["error", "skip"], default="error",
                   help="stop at the first bad record (default) or skip and count it")
    p.add_argument("--rows", choices=["best-fit", "bos-aligned", "packed"], default="best-fit",
                   help="best-fit (default): every row starts with a document's BOS, as the model is prompted, "
                        "and nothing is dropped; bos-aligned: the same, but a document that does not fit is "
                        "cropped; packed: EOS-separated documents cut every seq_len + 1 tokens (docs/quality.md)")
    p.add_argument("--rows-per-shard", type=int, default=None, metavar="N",
                   help="sequences per token file (default: about 256 MB of tokens per file)")
    p.add_argument("--num-cpus", type=int, default=None, metavar="N",
                   help="CPUs of the local Ray started for this run (default: all cores, at least 2); "
                        "ignored when connecting to a running Ray (RAY_ADDRESS)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --output if it already holds a prepared dataset")
    return p


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from minilm.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE

    for name in ("seq_len", "rows_per_shard", "num_cpus"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"{flag(name)} must be at least 1, got {getattr(args, name)}")
    if args.vocab_size is not None and args.vocab_size < MIN_VOCAB_SIZE:
        p.error(f"--vocab-size {args.vocab_size} is too small: a byte-level BPE needs at least "
                f"{MIN_VOCAB_SIZE} (3 special tokens + 256 bytes); MiniMind uses {DEFAULT_VOCAB_SIZE}")
    if not args.text_field:
        p.error("--text-field must not be empty")


def run(args: argparse.Namespace, argv: list[str], progress: Progress | None = None,
        stats: dict | None = None) -> dict:
    """Prepare the dataset `args` describe and return its manifest; `stats` is filled in as the run goes (a Ray it
    started is known even when it fails)."""
    from minilm import packing
    from minilm import tokenizer as T
    from minilm.data import PreparedData, file_sha256, record_verified

    progress = progress or Progress()
    warn = lambda m: progress.message(f"warning: {m}")  # noqa: E731
    skip_warn = SkipWarnings(warn)
    t_start = time.perf_counter()
    output = Path(args.output)
    sources = resolve_inputs(args.input, exclude=output, warn=warn)
    out = packing.AtomicOutput(output, overwrite=args.overwrite)
    stats = {} if stats is None else stats
    writer = None
    try:
        tok_path = out.tmp / packing.TOKENIZER_FILE
        t0 = time.perf_counter()
        tok, source = _tokenizer(args, sources, tok_path, skip_warn, stats)
        stats["tokenizer_s"] = time.perf_counter() - t0
        tokenizer = {"path": packing.TOKENIZER_FILE, "source": source, "sha256": file_sha256(tok_path),
                     "vocab_size": T.vocab_size_of(tok), **T.special_ids(tok)}
        reader = RecordReader(sources, args.text_field, args.on_bad_record, warn=skip_warn)
        writer = _writer(args, out.tmp, tokenizer)
        t0 = time.perf_counter()
        try:
            tokenize_and_pack(reader, writer, tok_path.read_text(encoding="utf-8"), tokenizer["sha256"],
                              tokenizer["eos_token_id"], args.num_cpus, progress, stats)
        finally:
            progress.done()
        stats["pipeline_s"] = time.perf_counter() - t0 - stats.get("ray_start_s", 0.0)
        if reader.documents == 0:
            raise _no_records(reader)
        result = writer.close()
        if result.num_sequences == 0:
            raise UsageError(f"the inputs give {result.stream_tokens} tokens ({reader.documents} documents), fewer "
                             f"than one sequence of seq_len + 1 = {args.seq_len + 1}; use a smaller --seq-len "
                             f"or more text")
        manifest = _manifest(args, argv, sources, reader, writer, result, tokenizer)
        packing.write_manifest(out.tmp, manifest)
        out.commit()
        record_verified(PreparedData(out.final, manifest))  # every file was hashed as it was written
    finally:
        if writer is not None:
            writer.abort()
        out.abort()
    stats["elapsed_s"] = time.perf_counter() - t_start
    return manifest


def _tokenizer(args: argparse.Namespace, sources: list, tok_path: Path, skip_warn: SkipWarnings, stats: dict):
    """(tokenizer, its source): `--tokenizer` copied into the output, or one trained on the inputs."""
    from minilm import tokenizer as T

    if args.tokenizer:
        tok = T.load_tokenizer(args.tokenizer)
        src_path = T.tokenizer_file(args.tokenizer)
        shutil.copyfile(src_path, tok_path)
        return tok, os.path.abspath(src_path)
    train_reader = RecordReader(sources, args.text_field, args.on_bad_record, warn=skip_warn)
    tok = T.train_tokenizer((text for text, _ in train_reader), args.vocab_size or T.DEFAULT_VOCAB_SIZE)
    if train_reader.documents == 0:
        raise _no_records(train_reader)
    T.save_tokenizer(tok, tok_path)
    stats["tokenizer_trained_on_documents"] = train_reader.documents
    return tok, "trained"


def _writer(args: argparse.Namespace, folder: Path, tokenizer: dict):
    """The shard writer of the `--rows` layout."""
    from minilm import packing
    from minilm.data import token_dtype_for

    kw = {"eos_id": tokenizer["eos_token_id"], "token_dtype": token_dtype_for(tokenizer["vocab_size"])}
    if args.rows == "packed":
        return packing.ShardWriter(folder, args.seq_len, args.rows_per_shard, **kw)
    return packing.BosAlignedShardWriter(folder, args.seq_len, args.rows_per_shard, **kw,
                                         bos_id=tokenizer["bos_token_id"], split_long=args.rows == "best-fit")


def _manifest(args, argv, sources, reader: RecordReader, writer, result, tokenizer: dict) -> dict:
    from minilm import packing

    extra = {"text_field": args.text_field, "on_bad_record": args.on_bad_record,
             "rows_per_shard": writer.rows_per_shard, "text_bytes": reader.text_bytes,
             "document_tokens": result.stream_tokens, "empty_inputs": reader.empty_inputs,
             "skipped_examples": reader.examples[:20], "rows": args.rows}
    if args.rows != "packed":
        extra["best_fit"] = dataclasses.asdict(writer.best_fit)
    return packing.build_manifest(
        result, tokenizer=tokenizer,
        inputs=[{"path": os.path.abspath(s.path), "bytes": s.bytes, "format": s.kind, **counts}
                for s, counts in zip(sources, reader.per_source, strict=True)],
        documents_read=reader.documents, documents_skipped=reader.documents_skipped,
        skipped_by_reason=dict(reader.skipped), command="python -m ray_jobs.prepare " + shlex.join(argv),
        extra=extra)


def _no_records(reader: RecordReader) -> UsageError:
    parts = [f"{n} {r}" for r, n in sorted(reader.skipped.items())]
    if reader.empty_inputs:
        parts.append(f"{len(reader.empty_inputs)} empty input(s)")
    return UsageError("the inputs hold no usable record" + (f" ({', '.join(parts)})" if parts else ""))


def summary_line(output: str, manifest: dict, stats: dict) -> str:
    m = manifest
    reasons = [f"{r} {n}" for r, n in m["skipped_by_reason"].items()]
    if m.get("empty_inputs"):
        reasons.append(f"empty inputs {len(m['empty_inputs'])}")
    skipped = f"; skipped {m['documents_skipped']} record(s) ({', '.join(reasons)})" if reasons else ""
    if m.get("rows") == "bos-aligned":
        fit = m["best_fit"]
        skipped += (f"; rows bos-aligned: {fit['cropped_documents']:,} of {fit['documents']:,} documents cropped "
                    f"({fit['cropped_tokens']:,} tokens not trained on), {fit['leftover_documents']} left over")
    elif m.get("rows") == "best-fit":
        fit = m["best_fit"]
        skipped += (f"; rows best-fit: {fit['split_documents']:,} of {fit['documents']:,} documents longer than a "
                    f"row split into rows of their own, {fit['leftover_tokens']:,} tokens left over at the end")
    dt = max(stats.get("pipeline_s", 0.0), 1e-9)
    return (f"prepared {output}: {m['num_sequences']:,} sequences of {m['seq_len']}+1 tokens in "
            f"{len(m['shards'])} shard(s) from {m['documents_read']:,} documents "
            f"({m['document_tokens']:,} tokens, {m['dropped_tail_tokens']} tail tokens dropped){skipped}; "
            f"tokenized at {m['text_bytes'] / 1e6 / dt:.2f} MB/s, {_si(m['document_tokens'] / dt)} tokens/s; "
            f"{stats.get('elapsed_s', 0.0):.1f}s in all (Ray start {stats.get('ray_start_s', 0.0):.1f}s, "
            f"tokenizer {stats.get('tokenizer_s', 0.0):.1f}s); fingerprint {m['fingerprint'][:16]}")


@command()
def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        check_args(parser, args)
    except SystemExit as e:  # argparse: usage errors exit 2, --help exits 0
        return int(e.code or 0)

    from minilm.packing import OutputError
    from minilm.tokenizer import TokenizerError

    in_main = threading.current_thread() is threading.main_thread()
    # SIGTERM raises KeyboardInterrupt too, so the temporary output folder is removed
    old_term = signal.signal(signal.SIGTERM, signal.default_int_handler) if in_main else None
    progress = Progress()
    stats: dict = {}
    try:
        manifest = run(args, argv, progress, stats)
    except (UsageError, OutputError, TokenizerError) as e:
        progress.message(f"error: {e}")
        if getattr(e, "hint", None):
            progress.message(f"hint: {e.hint}")
        return EXIT_USAGE
    except KeyboardInterrupt:
        progress.message(f"interrupted: nothing was written to {args.output}")
        return EXIT_INTERRUPTED
    except Exception as e:
        if type(e).__module__.startswith("ray"):
            progress.message(f"error: a Ray task failed while tokenizing: {e}")
            return EXIT_FAILED
        raise
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, old_term)
        if stats.get("started_ray"):
            import ray

            ray.shutdown()
    progress.message(summary_line(args.output, manifest, stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
