"""Smoke tests of the data benchmarks (bench.scale, bench.prepare) on tiny sizes, plus their page-cache helpers: they
run end to end, print their tables, write their JSON into a temporary folder and leave no dataset behind. The figures of
such tiny runs mean nothing; the real runs are in bench/RESULTS.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from conftest import run_env
from helpers import run_module

pytestmark = pytest.mark.ray


def run_bench(module: str, args: list[str], results: Path, env: dict | None = None) -> str:
    env = {**(env or os.environ), "MINILM_BENCH_RESULTS": str(results), "PYTHONUNBUFFERED": "1"}
    return run_module(module, args, env=env, timeout=300, check=True).stdout


def test_synthetic_dataset_and_page_cache_helpers(tmp_path):
    from bench.scale import drop_page_cache, resident_bytes, write_synthetic
    from minilm import data as D

    data = write_synthetic(tmp_path / "data", 100_000, 64, 6400)
    opened = D.open_prepared(tmp_path / "data")
    assert opened.num_sequences == 100_000 // 65 and opened.token_dtype == np.dtype("<u2")
    rows = D.SequenceStore(opened).take(np.arange(opened.num_sequences))
    assert rows.min() >= 3 and rows.max() < 6400
    drop_page_cache(data.shard_paths)
    assert resident_bytes(data.shard_paths) < data.num_bytes
    D.SequenceStore(opened).take(np.arange(opened.num_sequences))
    assert resident_bytes(data.shard_paths) >= data.num_bytes - 4096  # every page read is cached


@pytest.mark.nightly  # two Ray actors, each starting a Ray Data pipeline, per size: a minute or more on a busy machine
def test_scale(ray_address, tmp_path):
    out = run_bench("bench.scale", ["--tokens", "1e6", "2e6", "--samples", "600", "--seq-len", "64",
                                    "--micro-batch-size", "4", "--accumulation", "2", "--dir", str(tmp_path)],
                    tmp_path / "results", env=run_env(ray_address))
    assert "page cache of the dataset:" in out and "private gr." in out
    rows = json.loads((tmp_path / "results" / "scale.json").read_text())["rows"]
    assert [round(r["tokens"], -4) for r in rows] == [1e6, 2e6]
    for r in rows:
        assert [p["process"] for p in r["processes"]][:2] == ["rank 0", "rank 1"]
        assert all(x["tokens_per_s"] > 0 and x["rows"] >= 600 for x in r["ranks"])
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # the datasets are gone


@pytest.mark.nightly  # the real prepare command, twice, each starting its own Ray
def test_prepare(tmp_path):
    env = {**os.environ}
    env.pop("RAY_ADDRESS", None)
    out = run_bench("bench.prepare", ["--big-gb", "0.003", "--big-cpus", "1", "2", "--seq-len", "128", "--dir",
                                      str(tmp_path)], tmp_path / "results", env=env)
    assert "same fingerprint in every run: True" in out
    assert "speed-up 2 cores / 1:" in out
    result = json.loads((tmp_path / "results" / "prepare.json").read_text())
    assert [r["cpus"] for r in result["runs"]] == [1, 2] and result["encode_batch"]["mb_per_s"]["all cores"] > 0
    assert all(r["driver_peak_rss"] > 0 and r["worker_peak_rss"] > 0 for r in result["runs"])
    assert [p.name for p in tmp_path.iterdir()] == ["results"]  # corpus and dataset removed
