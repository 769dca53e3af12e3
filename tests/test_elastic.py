"""Elastic training on a simulated multi-node cluster: nodes lost and regained mid-run.

`ray.cluster_utils.Cluster` starts a head node (data tasks, the driver) and three worker nodes,
each offering one `slot`; every training worker needs one (`--resources-per-worker slot=1`), so
the world size follows the nodes alive. Drivers are `python -m ray_jobs.pretrain` subprocesses
joined to this cluster; the session's other local Ray is not used here.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import run_env
from helpers import ROOT, make_prepared, metrics, output_form, quoted_block
from inprocess import configs
from reference import check_run, recorded_steps, replay
from runs import is_complete, start_pretrain, timeline
from safetensors.torch import load_file

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 32  # 24 steps per epoch (240 sequences, global batch 10): the runs cross an epoch
# Global batch 10 in micro-batches of 2: world size 3 takes uneven slices (4, 3, 3), 2 takes 5 + 5 in micro-batches
# of 2, 2 and 1, so every resize changes how the same sequences are cut.
# Test-speed settings for the simulated cluster (inherited by every Ray process it starts).
CLUSTER_ENV = {
    "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S": "0.5",  # how often Ray Train looks for node drains (default 5)
    # How long a start waits for its placement group (default 60 s): one that counts a lost or draining node's slot
    # gives up and retries at the size the cluster has then; free slots place in milliseconds.
    "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "3",
}

# The GCS declares a killed node dead after 4 missed health checks 1 s apart (Ray's default: 5 missed, 3 s apart,
# ~15-25 s). A restart that starts before then still counts the dead node's slot and waits for it.
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 4}


# Ray Train grows a run when Ray's autoscaling coordinator has seen the new node, which it looks for every 20 s (a
# class constant; ~20 s of a real node's minutes of start-up). The simulated cluster's coordinator is created first,
# here, looking every second; Ray Train's get-or-create finds it by name.
FAST_COORDINATOR = """
import sys
import ray
from ray.data._internal.cluster_autoscaler import default_autoscaling_coordinator as coordinator
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
fast = type("FastTickCoordinator", (coordinator._AutoscalingCoordinatorActor,), {"TICK_INTERVAL_S": 1})
actor = ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)(fast).options(
    name="AutoscalingCoordinator", namespace="AutoscalingCoordinator", get_if_exists=True, lifetime="detached",
    scheduling_strategy=NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)).remote()
assert ray.get(actor.__ray_call__.remote(lambda self: self.TICK_INTERVAL_S)) == 1
"""


def run_args(data: Path, storage: Path, name: str, *extra: str) -> list[str]:
    return ["--data", str(data), "--seq-len", "32", "--vocab-size", "256", "--hidden-size", "64",
            "--num-hidden-layers", "2", "--num-attention-heads", "4", "--num-key-value-heads", "2",
            "--max-steps", str(STEPS), "--warmup-steps", "2", "--micro-batch-size", "2", "--global-batch-size", "10",
            "--log-every", "4", "--checkpoint-every", "4", "--dtype", "fp32", "--run-dir", str(storage / name),
            "--num-workers", "1-3", "--resources-per-worker", "slot=1", "--max-failures", "6",
            "--elastic-check-seconds", "2", "--lr", "1e-3", "--cpus-per-worker", "1",
            # AdamW, not the default Muon: the replay (tests/reference.py) then recomputes the run with torch's own
            # optimizer, no code of minilm's
            "--optimizer", "adamw", *extra]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        for k, v in CLUSTER_ENV.items():
            mp.setenv(k, v)  # the cluster's processes inherit them
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "include_dashboard": False,
                                                          "_system_config": HEALTH_CHECKS})
        c.slot_nodes = [c.add_node(num_cpus=2, resources={"slot": 1}) for _ in range(3)]
        c.wait_for_nodes()
        fast = subprocess.run([sys.executable, "-c", FAST_COORDINATOR, c.address], capture_output=True, text=True,
                              timeout=120)
        assert fast.returncode == 0, fast.stderr[-3000:]
        yield c
        c.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_prepared(tmp_path_factory.mktemp("data") / "tiny240", num_sequences=240, seq_len=32, vocab_size=256,
                         rows_per_shard=100)


@pytest.fixture(scope="module")
def storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("runs")


def env(cluster, **extra) -> dict:
    return run_env(cluster.address, **extra)


def final_ids_per_step(record_dir: Path) -> dict[int, list[int]]:
    """optimizer_step -> sorted sample ids of the attempt that counted (the latest one of each step)."""
    return {step: sorted(ids) for step, ids in recorded_steps(record_dir).items()}


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / f"checkpoint_{STEPS:08d}" / "model.safetensors"))


class Driver:
    """A pretrain driver in the background, and waits on its run folder."""

    def __init__(self, cluster, args: list[str], run_dir: Path, log: Path, **extra_env: str):
        self.run_dir, self.log_path = run_dir, log
        self.proc = start_pretrain(cluster.address, args, capture=False, log=log, **extra_env)

    def wait_for(self, what: str, condition, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.proc.kill()
        pytest.fail(f"waiting for {what}: driver exit code {self.proc.poll()}\n{self.log_path.read_text()[-6000:]}")

    def wait_for_event(self, event: str, timeout: float = 240) -> dict:
        self.wait_for(f"a {event!r} row in world_size.csv",
                      lambda: any(r["event"] == event for r in timeline(self.run_dir)), timeout)
        return next(r for r in timeline(self.run_dir) if r["event"] == event)

    def finish(self, timeout: float = 300) -> str:
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        log = self.log_path.read_text()
        assert code == 0, log[-6000:]
        return log


def check_exact_resume(run_dir: Path, ids_dir: Path, data: Path) -> None:
    """Same global batch at every world size: each step's samples are the order contract's (the replay checks
    them step by step), every sample once per epoch, and the final weights and every logged lr and loss are the
    independent replay's."""
    ids = final_ids_per_step(ids_dir)
    assert list(ids) == list(range(1, STEPS + 1))
    epoch = [i for step in range(1, 25) for i in ids[step]]  # the first epoch: 24 steps
    assert len(epoch) == len(set(epoch)) == 240  # none twice, none skipped (val_samples 0: all 240 train)
    model_cfg, train_cfg = configs(max_steps=STEPS, micro_batch_size=2, global_batch_size=10)
    # The replay accumulates the 5 micro-batches in one process; the run averages them over 2 or 3 ranks, float sums
    # in another order, which Adam carries through 32 steps (5e-5 seen). The mistakes this catches (an lr one step
    # off, another sample order, a micro-batch lost in a resize) move the weights by 1e-2 and more.
    check_run(replay(model_cfg, train_cfg, data, ids_dir, STEPS), weights(run_dir), metrics(run_dir),
              rtol_weights=2e-4, rtol_grad_norm=2e-4)


def test_drained_then_lost_nodes_shrink_and_grow_without_changing_the_optimisation(cluster, data, storage, tmp_path):
    """Three resizes in one run. 3 -> 2: a node drained (what a spot reclaim or the autoscaler sends), then removed:
    checkpoint at the step boundary, nothing redone. 2 -> 3: a node added. 3 -> 2: a node killed outright: restart
    from the newest complete checkpoint, at most a checkpoint interval redone."""
    name, ids, hold = "drained-regained-lost", tmp_path / "ids", tmp_path / "hold"
    run_dir = storage / name
    driver = Driver(cluster, run_args(data, storage, name), run_dir, tmp_path / "driver.log",
                    MINILM_TEST_STEP_DELAY_S="0.3", MINILM_TEST_HOLD_FILE=str(hold), MINILM_TEST_RECORD_SAMPLE_IDS=str(ids))
    driver.wait_for("checkpoint 8", lambda: (run_dir / "checkpoint_00000008" / "COMPLETE.json").is_file())
    victim = cluster.slot_nodes.pop()
    drain = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", cluster.address,
                            "--node-id", victim.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                            "--reason-message", "test: spot reclaim", "--deadline-remaining-seconds", "30"],
                           capture_output=True, text=True, timeout=60)
    assert drain.returncode == 0, drain.stderr
    preempt = driver.wait_for_event("preempt")
    time.sleep(1)  # the reclaim: the node goes away after the workers have checkpointed and exited
    cluster.remove_node(victim, allow_graceful=True)  # a drained node's raylet tells the GCS it is leaving
    drained = driver.wait_for_event("shrink")
    # The 2 workers wait at a step boundary until the run has grown: Ray sees the new node at its coordinator's next
    # refresh (1 s here, FAST_COORDINATOR) and then restarts the group, longer than the rest of this tiny run takes.
    hold.touch()
    cluster.slot_nodes.append(cluster.add_node(num_cpus=2, resources={"slot": 1}))
    grow = driver.wait_for_event("grow")
    hold.unlink()
    after_grow = (grow["optimizer_step"] // 4 + 1) * 4  # the first checkpoint the 3 workers write
    # complete, not only its marker: Ray copies a checkpoint's files in any order, and a node lost while the marker
    # is half-copied leaves it torn (the restart then skips it, rightly, for the one before)
    driver.wait_for(f"checkpoint {after_grow}, at world size 3",
                    lambda: is_complete(run_dir / f"checkpoint_{after_grow:08d}"))
    cluster.remove_node(cluster.slot_nodes.pop(), allow_graceful=False)
    driver.wait_for("the restart after the node loss", lambda: len(timeline(run_dir)) >= 5)
    log = driver.finish()

    rows = timeline(run_dir)
    assert [(r["event"], r["world_size"], r["accumulation_steps"]) for r in rows] == [
        ("start", 3, 2), ("preempt", 3, 2), ("shrink", 2, 3), ("grow", 3, 2), ("shrink", 2, 3), ("finish", 2, 3)], rows
    assert "node drain at optimizer step" in log
    assert drained["optimizer_step"] == preempt["optimizer_step"] >= 8  # resumed from the drain checkpoint
    assert drained["redone_steps"] == 0
    assert grow["optimizer_step"] >= drained["optimizer_step"]
    assert rows[4]["optimizer_step"] >= after_grow  # from a checkpoint the 3 workers wrote
    assert "shrink: world size 2 x accumulation 3" in log and "grow: world size 3 x accumulation 2" in log
    redone = [r["redone_steps"] for r in rows]
    assert all(0 <= n < 4 + 4 for n in redone), redone  # at most what the checkpoint interval (4) can lose, + 1 window
    records = metrics(run_dir)
    assert [m["optimizer_step"] for m in records] == sorted({m["optimizer_step"] for m in records})
    assert records[-1]["redone_steps"] == sum(redone)
    assert {m["world_size"] for m in records} == {2, 3}
    check_exact_resume(run_dir, ids, data)
    cluster.slot_nodes.append(cluster.add_node(num_cpus=2, resources={"slot": 1}))  # leave 3 slots for later tests
    print(f"timeline: {[(r['optimizer_step'], r['world_size'], r['event'], r['redone_steps']) for r in rows]}")


def test_multi_node_run_with_node_local_storage_is_refused(cluster, data, tmp_path):
    """The driver runs in its own mount namespace with a private tmpfs over --storage-path: the folder it writes
    there is really invisible to the cluster's nodes, as a node-local disk would be."""
    storage = tmp_path / "runs"
    storage.mkdir()
    if subprocess.run(["unshare", "--mount", "--map-root-user", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --mount --map-root-user is not allowed here: no private storage for the driver")
    args = " ".join(run_args(data, storage, "local-storage"))
    proc = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c",
                           f"mount -t tmpfs tmpfs {storage} && exec {sys.executable} -m ray_jobs.pretrain {args}"],
                          cwd=ROOT, env=env(cluster), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    # the head node and the 3 worker nodes: every node but the driver's private view
    assert len(error) == 1 and "not visible from 4 node(s)" in error[0] and "s3://" in error[0] \
        and "NFS" in error[0], proc.stderr[-3000:]
    assert not (storage / "local-storage").exists() and not list(storage.iterdir())  # nothing reached the real disk
    quoted = " ".join(quoted_block("docs/elastic.md", "error: --storage-path"))  # its lines joined: one printed
    assert output_form(error[0].split(" (")[0]) == output_form(quoted.split(" (")[0])
    assert error[0].split("): ", 1)[1] == quoted.split("): ", 1)[1]
