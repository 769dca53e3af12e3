"""Elastic runs on a Ray cluster: the shared-storage check. (The world-size timeline is `minilm.timeline`.)"""

from __future__ import annotations

import uuid
from pathlib import Path

SHARED_STORAGE_HINT = ("a multi-node run needs a --storage-path every node can read and write: an s3:// or gs:// "
                       "URI, or a shared filesystem mounted at the same path on every node (NFS, EFS, Filestore, "
                       "Lustre, a ReadWriteMany PersistentVolume)")


def nodes_missing_path(storage: Path, hide_on_other_nodes: bool = False) -> list[str]:
    """Addresses of alive Ray nodes that cannot see a marker file written here under `storage`.

    One zero-CPU task per node, pinned to it. `hide_on_other_nodes` is a test hook: it makes every
    node but this one report the marker missing, as it would be with node-local storage.
    """
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return []
    storage.mkdir(parents=True, exist_ok=True)
    marker = storage / f".minilm-storage-check-{uuid.uuid4().hex}"
    marker.write_text("written by the driver's node")
    here = ray.get_runtime_context().get_node_id()

    @ray.remote(num_cpus=0)
    def sees(path: str, hide: bool) -> bool:
        return not hide and Path(path).is_file()

    try:
        refs = {n["NodeManagerAddress"] + f" ({n['NodeID'][:8]})":
                sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(marker), hide_on_other_nodes and n["NodeID"] != here)
                for n in nodes}
        results = dict(zip(refs, ray.get(list(refs.values()), timeout=120), strict=True))
    finally:
        marker.unlink(missing_ok=True)
    return sorted(name for name, ok in results.items() if not ok)
