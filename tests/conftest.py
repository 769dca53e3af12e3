"""Shared fixtures: one local Ray per test session, small prepared datasets, an S3 server, and the baseline run.

`run_data`, `run_storage` and `baseline` serve tests/test_pretrain.py and the fault-injection suite
in tests/faults/ (helpers in tests/runs.py): the uninterrupted reference run is made once per session.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_prepared  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--nightly", action="store_true", help="also run the tests marked nightly (the 100-step demo)")


def pytest_collection_modifyitems(config, items):
    # The tests on the session's Ray last: it starts with the first of them and stops at the end, so the tests that
    # start a Ray or a cluster of their own never run beside it (after a few jobs its idle processes, Ray Data's
    # detached actors among them, take ~0.1 cores: bench/RESULTS.md).
    items.sort(key=lambda item: "ray_address" in item.fixturenames)
    if config.getoption("--nightly"):
        return
    skip = pytest.mark.skip(reason="nightly (minutes): make test-nightly, or pytest --nightly")
    for item in items:
        if "nightly" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def test_cache(tmp_path_factory):
    """The session's MINILM_CACHE (the prepared demo corpus, data verification stamps): never the user's
    ~/.cache/minilm. Subprocess drivers and the Ray workers inherit it."""
    cache = tmp_path_factory.mktemp("minilm-cache")
    before = os.environ.get("MINILM_CACHE")
    os.environ["MINILM_CACHE"] = str(cache)
    yield cache
    if before is None:
        os.environ.pop("MINILM_CACHE", None)
    else:
        os.environ["MINILM_CACHE"] = before


@pytest.fixture(scope="session")
def ray_address(test_cache):
    """Start one local Ray for the session; subprocess drivers join it through RAY_ADDRESS.

    8 logical CPUs on a 2-core machine: training workers must not take every CPU, or the Ray Data
    tasks that feed them never run. With the dashboard, as a user's Ray has it: Ray Train's placement-group
    cleaner asks the State API (the dashboard) whether a controller died, and without it a Tune trial stopped
    by its scheduler keeps its workers' CPUs reserved for good.
    """
    import ray

    if ray.is_initialized():  # a test before leaked one (ray.get_gpu_ids() and the like start a 2-CPU Ray)
        pytest.fail(f"a Ray already runs in this process ({ray.cluster_resources().get('CPU')} CPUs): a test before "
                    "the session's Ray tests started it and did not shut it down", pytrace=False)
    # address="local": never join another Ray that happens to run on the machine
    ray.init(address="local", num_cpus=8, include_dashboard=True, log_to_driver=False, logging_level="ERROR")
    address = ray.get_runtime_context().gcs_address
    yield address
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_run_outlives_its_test(request):
    """A test that fails while its run is held or slowed down leaves the driver and its Ray workers running: they
    are ended here, after every test on the session's Ray, so the failure stays that test's own."""
    yield
    if "ray_address" in request.fixturenames:
        from runs import end_leftover_runs

        end_leftover_runs()


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A prepared dataset: 480 sequences of seq_len 32, vocab 256 (learnable, repetitive text)."""
    return make_prepared(tmp_path_factory.mktemp("data") / "tiny", num_sequences=480, seq_len=32, vocab_size=256)


@pytest.fixture(scope="session")
def run_data(tmp_path_factory) -> Path:
    """The dataset of the end-to-end pretrain runs: 240 sequences of seq_len 32, vocab 256, in 3 shards."""
    return make_prepared(tmp_path_factory.mktemp("data") / "tiny240", num_sequences=240, seq_len=32, vocab_size=256,
                         rows_per_shard=100)


@pytest.fixture(scope="session")
def run_storage(tmp_path_factory) -> Path:
    """One --storage-path for every end-to-end run of the session (each run has its own --name)."""
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def s3():
    """An S3-compatible server (moto's, tests/s3_server.py) with an empty `bucket`, for s3:// run folders."""
    from s3_server import S3Server

    server = S3Server().start()
    server.filesystem().create_dir("bucket")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def baseline(ray_address, run_data, run_storage, tmp_path_factory):
    """An uninterrupted 2-worker run of tests/runs.py's tiny_args: the reference every resumed run is compared with."""
    from runs import consumed_ids, final_weights, pretrain, tiny_args

    ids = tmp_path_factory.mktemp("ids-baseline")
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "baseline", "--num-workers", "2"),
                    MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    return {"weights": final_weights(run_storage, "baseline"), "ids": consumed_ids(ids), "log": proc.stdout,
            "stderr": proc.stderr, "ids_dir": ids}


def run_env(ray_address: str | None, **extra: str) -> dict:
    """The environment of a driver subprocess; fault-injection hooks (MINILM_TEST_*) come with their switch."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MINILM_TEST")}
    env.update({"PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0", **extra})
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    if any(k.startswith("MINILM_TEST_") for k in extra):
        env["MINILM_TESTING"] = "1"
    return env
