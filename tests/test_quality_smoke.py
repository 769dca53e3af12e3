"""Smoke test of bench.quality on a tiny config (the figures mean nothing here; bench/RESULTS.md has
the real runs): it trains the reference loop, minilm's loop and minilm with its best options, prints
the table, writes quality.json; a bad --input or --runs is one `error:` line and exit code 2."""

from __future__ import annotations

import json
import os

import pytest
from helpers import run_module

TINY = ["--max-docs", "200", "--vocab-size", "300", "--hidden-size", "32", "--num-hidden-layers", "1",
        "--num-attention-heads", "4", "--num-key-value-heads", "2", "--seq-len", "32", "--batch-size", "2",
        "--steps", "3", "--dtype", "fp32"]


def env(tmp_path) -> dict:
    return {**os.environ, "MINILM_BENCH_RESULTS": str(tmp_path), "OMP_NUM_THREADS": "1"}


def test_quality_table(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"Document {i}: " + "some words here " * (i % 9 + 1)}) + "\n"
                              for i in range(120)))
    proc = run_module("bench.quality", [*TINY, "--input", str(corpus), "--runs", "reference,minilm,best"],
                      env=env(tmp_path), timeout=240, check=True)
    assert "minilm / reference: bits per byte" in proc.stdout
    assert "best / reference: bits per byte" in proc.stdout
    assert "best / minilm" in proc.stdout.splitlines()[-1]  # the alternating step-time line
    result = json.loads((tmp_path / "quality.json").read_text())
    runs = {r["run"]: r for r in result["results"]}
    assert list(runs) == ["reference", "minilm", "best"]
    assert [runs[n]["rows"] for n in runs] == ["padded", "best-fit", "best-fit"]
    # Every run is scored on the same held-out text: the same bytes, a finite figure.
    assert len({r["bytes"] for r in runs.values()}) == 1
    for r in runs.values():
        assert 0 < r["bpb"] < 20 and r["train_s"] > 0
    assert set(result["step_times"]) == {"minilm", "best"}


@pytest.mark.parametrize("args, message", [
    (["--input", "/nonexistent/corpus.jsonl"], "error: --input /nonexistent/corpus.jsonl: file not found"),
    (["--runs", "reference,nonsense"], "error: --runs: unknown run 'nonsense'"),
])
def test_bad_invocation_is_one_error_line(tmp_path, args, message):
    proc = run_module("bench.quality", [*TINY, *args], env=env(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and proc.stderr.startswith(message)


def test_corrupt_jsonl_names_the_line(tmp_path):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\nnot json\n')
    proc = run_module("bench.quality", [*TINY, "--input", str(corpus)], env=env(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == f'error: --input {corpus}:2: not a JSON object with a "text" field'
