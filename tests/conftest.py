"""Shared fixtures: one local Ray per test session, and small prepared datasets."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_prepared  # noqa: E402


@pytest.fixture(scope="session")
def ray_address():
    """Start one local Ray for the session; subprocess drivers join it through RAY_ADDRESS.

    8 logical CPUs on a 2-core machine: training workers must not take every CPU, or the Ray Data
    tasks that feed them never run.
    """
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    address = ray.get_runtime_context().gcs_address
    yield address
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared dataset: 480 sequences of seq_len 32, vocab 256 (learnable, repetitive text)."""
    return make_prepared(tmp_path_factory.mktemp("data") / "tiny", num_sequences=480, seq_len=32, vocab_size=256)


def run_env(ray_address: str, **extra: str) -> dict:
    env = {**os.environ, "RAY_ADDRESS": ray_address, "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    env.update(extra)
    return env
