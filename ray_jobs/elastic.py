"""Elastic runs on a Ray cluster: the shared-storage check. (The world-size timeline is `minilm.timeline`.)"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

SHARED_STORAGE_HINT = ("a multi-node run needs a --run-dir every node can read and write: an s3:// or gs:// "
                       "URI, or a shared filesystem mounted at the same path on every node (NFS, EFS, Filestore, "
                       "Lustre, a ReadWriteMany PersistentVolume)")


def nodes_missing_path(storage: Path) -> list[str]:
    """Addresses of alive Ray nodes that cannot see a marker file written here under `storage` (a task on each)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if len(nodes) <= 1:
        return []
    created = [p for p in (storage, *storage.parents) if not p.exists()]  # removed after (a --dry-run keeps none)
    storage.mkdir(parents=True, exist_ok=True)
    marker = storage / f".minilm-storage-check-{uuid.uuid4().hex}"
    marker.write_text("written by the driver's node")

    @ray.remote(num_cpus=0)
    def sees(path: str) -> bool:
        return Path(path).is_file()

    try:
        refs = {n["NodeManagerAddress"] + f" ({n['NodeID'][:8]})":
                sees.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                .remote(str(marker))
                for n in nodes}
        results = dict(zip(refs, ray.get(list(refs.values()), timeout=120), strict=True))
    finally:
        marker.unlink(missing_ok=True)
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
    return sorted(name for name, ok in results.items() if not ok)
