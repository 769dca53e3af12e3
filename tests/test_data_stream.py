"""`ray_jobs.stream.RankStream` end to end: the rows of the rank's order, from any start step; its
reader on the rank's own node; remote data copied once to that node."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from helpers import ROOT, make_prepared, reference_rows

from minilm import data as D

pytestmark = pytest.mark.ray


def test_rank_stream_delivers_the_rows_of_its_order(ray_address, tmp_path):
    import torch

    from ray_jobs.stream import RankStream

    path = make_prepared(tmp_path / "tok", num_sequences=130, seq_len=16, vocab_size=300, rows_per_shard=40)
    rows = reference_rows(path)
    train_ids, _ = D.split_ids(130, 10)
    G, W, m, start, total = 12, 2, 3, 7, 22  # 10 steps per epoch: the stream crosses an epoch start
    spe = D.steps_per_epoch(len(train_ids), G)
    stream = RankStream(str(path), D.RankOrder(None, 5, spe, G, W, 1, start, num_sequences=130, val_samples=10),
                        total, m, "cpu")  # its reader remakes the training ids
    order = D.RankOrder(train_ids, 5, spe, G, W, 1, start)
    for step, (batches, ids) in enumerate(stream):
        np.testing.assert_array_equal(ids, order.sample_ids(np.arange(step * 6, (step + 1) * 6)))
        assert [b.shape for b in batches] == [(m, 17)] * 2 and all(b.dtype == torch.int64 for b in batches)
        np.testing.assert_array_equal(torch.cat(batches).numpy(), rows[ids])
    assert step == total - start - 1 and stream.data_wait_s > 0
    del stream


# A head node and a second node, each with its own MINILM_CACHE; a "rank" pinned to the second node
# streams remote (file://) data. Run in its own process: the test session already runs a Ray.
TWO_NODES = """
import json, os, sys
import numpy as np
import ray
from ray.cluster_utils import Cluster

uri, cache_head, cache_b = sys.argv[1], sys.argv[2], sys.argv[3]
os.environ["MINILM_CACHE"] = cache_head
cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
node_b = cluster.add_node(num_cpus=2, resources={"node_b": 1}, env_vars={"MINILM_CACHE": cache_b})
cluster.wait_for_nodes()
ray.init(address=cluster.address, log_to_driver=False, logging_level="ERROR")


@ray.remote(num_cpus=0, resources={"node_b": 0.01})
def rank(uri):
    from minilm import data as D
    from ray_jobs.stream import RankStream

    remote = D.open_prepared(uri)
    order = D.RankOrder(None, 1, 10, 8, 1, 0, 0, num_sequences=remote.num_sequences)
    ids, copies = [], []
    for _ in range(3):  # a rank, then the same rank restarted twice: one copy between them (and Ray Data spreads
        # its actors over the nodes by default: 3 readers all on node B by chance would be rare)
        stream = RankStream(uri, order, 3, 4, "cpu")
        ids.append([int(i) for _, step_ids in stream for i in step_ids])
        del stream
        copy = D.cache_root() / "data" / remote.fingerprint[:32] / "shard-00000.bin"
        copies.append(os.stat(copy).st_ino)
    return ray.get_runtime_context().get_node_id(), ids, copies


node, ids, copies = ray.get(rank.remote(uri))
print(json.dumps({"rank_node": node, "node_b": node_b.node_id, "ids": ids, "copies": copies}))
ray.shutdown()
cluster.shutdown()
"""


@pytest.mark.slow  # a 2-node cluster of its own
@pytest.mark.timeout(300)
def test_reader_runs_on_its_ranks_node_and_copies_remote_data_there(tmp_path):
    path = make_prepared(tmp_path / "tok", num_sequences=60, seq_len=16, vocab_size=300, rows_per_shard=25)
    fingerprint = json.loads((path / "manifest.json").read_text())["fingerprint"]
    cache_head, cache_b = tmp_path / "cache-head", tmp_path / "cache-b"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-c", TWO_NODES, f"file://{path}", str(cache_head), str(cache_b)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["rank_node"] == out["node_b"]
    expected = D.RankOrder(np.arange(60), 1, 10, 8, 1, 0, 0).sample_ids(np.arange(24)).tolist()
    assert out["ids"] == [expected] * 3
    assert len(set(out["copies"])) == 1  # the restarted rank's readers reused the first copy
    copy = cache_b / "data" / fingerprint[:32]  # the reader read its node's copy ...
    assert sorted(p.name for p in copy.iterdir()) == ["manifest.json", "shard-00000.bin", "shard-00001.bin",
                                                       "shard-00002.bin", "tokenizer.json"]
    assert not (cache_head / "data").exists()  # ... and nothing was copied to the other node
