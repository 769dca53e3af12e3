"""Reading prepared data, and the sample order that makes resume exact at any world size.

Storage (docs/data.md): a prepared dataset is a folder of raw token files, `shard-NNNNN.bin`, each
an uncompressed little-endian array of rows of `seq_len + 1` token ids (uint16 when the vocabulary
fits, uint32 otherwise), described by `manifest.json`. `SequenceStore` reads rows by sample id with
positional reads (`os.preadv`) straight from those files: nothing is decoded and nothing is held,
so the only copy of the tokens in memory is the kernel's page cache, which every process on a node
shares. Memory per process stays flat whatever the size of the dataset. Remote data (`s3://`,
`gs://`, any pyarrow filesystem URI) is copied once per node into a cache folder (`open_local`),
verified against the manifest's hashes; every rank on the node and every restart reuse that copy.

Order: the resumable iterator Ray Data lacks (ray-project/ray#37633, #48224) is built from three
pure functions instead of iterator state:

* `epoch_order(train_ids, seed, epoch)`: a seeded permutation of the training sample ids;
* optimizer step s of an epoch consumes positions [s*G, (s+1)*G) of that order (G = global batch),
  whatever the world size;
* worker r of W takes the r-th contiguous G/W slice of each global batch and reads it as
  accumulation_steps micro-batches (`RankOrder`, the one place this arithmetic lives).

So the only position to save is the optimizer step (samples_seen = step * G), and a resumed run at
any world size consumes exactly the samples the uninterrupted run would have, step by step.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = "minilm-packed-v2"
TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
VAL_SEED = 0x5EED  # the held-out slice is fixed, independent of the training seed
MAX_OPEN_SHARDS = 256  # file descriptors a SequenceStore keeps open (least recently used are closed)
COPY_CHUNK = 8 << 20
RACY_NS = 2_000_000_000  # a file modified this recently when hashed is hashed again next time
_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")


class DataError(ValueError):
    """Prepared data is missing, incomplete, or does not fit the run; the message says what and where."""


def cache_root() -> Path:
    """Where minilm keeps node-local state: $MINILM_CACHE, else ~/.cache/minilm."""
    return Path(os.environ.get("MINILM_CACHE") or Path.home() / ".cache" / "minilm").expanduser()


def is_remote(location: str | os.PathLike) -> bool:
    """A URI with a scheme (s3://, gs://, file://, ...): read through pyarrow.fs and copied to each node."""
    return isinstance(location, str) and bool(_URI.match(location))


def token_dtype_for(vocab_size: int) -> str:
    """The narrowest token type that holds every id of a vocabulary: uint16 up to 65,536 tokens."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# ---- the prepared dataset -----------------------------------------------------------------------

@dataclass(frozen=True)
class PreparedData:
    """A checked manifest and where its files are: a local folder (`path`), or a remote URI (`uri`, path None)."""

    path: Path | None
    manifest: dict
    uri: str | None = None

    @property
    def location(self) -> str:
        return self.uri if self.uri is not None else str(self.path)

    @property
    def num_sequences(self) -> int:
        return int(self.manifest["num_sequences"])

    @property
    def seq_len(self) -> int:
        return int(self.manifest["seq_len"])

    @property
    def fingerprint(self) -> str:
        return str(self.manifest["fingerprint"])

    @property
    def tokenizer_sha256(self) -> str:
        return str(self.manifest["tokenizer"]["sha256"])

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["tokenizer"]["vocab_size"])

    @property
    def token_dtype(self) -> np.dtype:
        return TOKEN_DTYPES[self.manifest["token_dtype"]]

    @property
    def num_bytes(self) -> int:
        return sum(int(s["bytes"]) for s in self.manifest["shards"])

    @property
    def tokenizer_path(self) -> Path:
        return self._local() / TOKENIZER_FILE

    @property
    def shard_paths(self) -> list[Path]:
        return [self._local() / s["file"] for s in self.manifest["shards"]]

    def _local(self) -> Path:
        if self.path is None:
            raise DataError(f"{self.uri} is remote: read it through minilm.data.open_local, which copies it to "
                            f"this node")
        return self.path


def _files(manifest: dict) -> list[tuple[str, int | None, str]]:
    """(name, bytes or None, sha256) of every file the manifest lists: the tokenizer, then the shards."""
    return [(TOKENIZER_FILE, None, manifest["tokenizer"]["sha256"])] + [
        (s["file"], int(s["bytes"]), s["sha256"]) for s in manifest["shards"]]


def check_manifest(manifest, where: str) -> None:
    """Refuse a manifest that is malformed, of another format, or inconsistent with itself."""
    if not isinstance(manifest, dict):
        raise DataError(f"{where}: format {type(manifest).__name__!r} is not {FORMAT!r}")
    if manifest.get("format") != FORMAT:
        raise DataError(f"{where}: format {manifest.get('format')!r} is not {FORMAT!r}")
    missing = [k for k in ("seq_len", "num_sequences", "shards", "tokenizer", "fingerprint", "token_dtype")
               if k not in manifest]
    if missing:
        raise DataError(f"{where}: missing {', '.join(missing)}")
    try:
        _check_layout(manifest, where)
    except DataError:
        raise
    except (KeyError, TypeError, ValueError) as e:  # a field of the wrong type, a shard without a key
        raise DataError(f"{where}: malformed ({type(e).__name__}: {e})") from None


def _check_layout(manifest: dict, where: str) -> None:
    dtype_name = manifest["token_dtype"]
    if dtype_name not in TOKEN_DTYPES:
        raise DataError(f"{where}: token_dtype {dtype_name!r} is not one of {', '.join(TOKEN_DTYPES)}")
    vocab = int(manifest["tokenizer"]["vocab_size"])
    if TOKEN_DTYPES[token_dtype_for(vocab)].itemsize > TOKEN_DTYPES[dtype_name].itemsize:
        raise DataError(f"{where}: token_dtype {dtype_name} cannot hold the ids of a {vocab}-token vocabulary")
    row_bytes = (int(manifest["seq_len"]) + 1) * TOKEN_DTYPES[dtype_name].itemsize
    expected_first = 0
    for shard in manifest["shards"]:
        name = str(shard["file"])
        if "/" in name or "\\" in name or name.startswith("."):
            raise DataError(f"{where}: shard file name {name!r} is not a plain file name")
        if int(shard["first_sample_id"]) != expected_first:
            raise DataError(f"{where}: shard {name} starts at sample {shard['first_sample_id']}, expected "
                            f"{expected_first} (sample ids must be contiguous across shards)")
        n = int(shard["num_sequences"])
        if int(shard["bytes"]) != n * row_bytes:
            raise DataError(f"{where}: shard {name} lists {int(shard['bytes']):,} bytes, but {n:,} rows of "
                            f"seq_len + 1 = {int(manifest['seq_len']) + 1} {dtype_name} tokens take "
                            f"{n * row_bytes:,}: the manifest disagrees with itself")
        expected_first += n
    if expected_first != int(manifest["num_sequences"]):
        raise DataError(f"{where}: shard sizes do not add up to num_sequences {manifest['num_sequences']}")


def open_prepared(path: str | os.PathLike, *, verify: bool = True) -> PreparedData:
    """Open a dataset written by `ray_jobs.prepare`, checking that it is complete and intact.

    A local folder: the manifest, every file's presence and size, and (with `verify`) every file's
    sha256, hashed once per machine (`verify_hashes`). A remote URI: the manifest and every file's
    size, read remotely; `open_local` makes the copy that the readers use.
    """
    if is_remote(path):
        return _open_remote(str(path))
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"data directory {path} does not exist (make one with `python -m ray_jobs.prepare`)")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise DataError(f"{path} has no {MANIFEST}: not a prepared dataset, or its prepare did not finish")
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{mpath} is not valid JSON ({e})") from None
    check_manifest(manifest, str(mpath))
    data = PreparedData(path, manifest)
    for name, size, _ in _files(manifest):
        try:
            actual = (path / name).stat().st_size
        except FileNotFoundError:
            what = "tokenizer.json" if name == TOKENIZER_FILE else f"token file {name} listed in {MANIFEST}"
            raise DataError(f"{path}: {what} is missing") from None
        if size is not None and actual != size:
            raise DataError(_size_message(str(path / name), actual, size))
    if verify:
        verify_hashes(data)
    return data


def _size_message(where: str, actual: int, expected: int) -> str:
    how = "truncated" if actual < expected else "longer than listed"
    return (f"{where} holds {actual:,} bytes but {MANIFEST} lists {expected:,} ({how}, or not this dataset's "
            f"file); prepare the dataset again")


def _hash_mismatch(where: str, got: str, want: str) -> str:
    return (f"{where}: sha256 {got[:16]}... does not match {MANIFEST}'s {want[:16]}... (the file changed or is "
            f"corrupt); prepare the dataset again")


def check_compatible(data: PreparedData, *, vocab_size: int, seq_len: int) -> None:
    """Refuse data that does not fit the model before any worker starts."""
    problems = []
    if data.vocab_size > vocab_size:
        problems.append(f"its tokenizer has {data.vocab_size} tokens but the model's vocab_size is {vocab_size} "
                        f"(set --vocab-size {data.vocab_size})")
    if data.seq_len != seq_len:
        problems.append(f"it was packed with seq_len {data.seq_len} but the run asks for seq_len {seq_len} "
                        f"(set --seq-len {data.seq_len} or prepare again)")
    if problems:
        raise DataError(f"data {data.location} does not fit this run: " + "; ".join(problems))


# ---- verification, once per machine ---------------------------------------------------------------

@contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive lock between the processes of this node (the ranks and reader actors of a run)."""
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # no writable cache folder: go on unlocked (each process then does its own work)
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _stamp_path(folder: Path) -> Path:
    key = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return cache_root() / "verified" / f"{key}.json"


def _file_key(path: Path) -> list[int]:
    st = path.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ino]


def _read_stamp(stamp: Path, data: PreparedData) -> dict:
    try:
        saved = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(saved, dict) or saved.get("fingerprint") != data.fingerprint:
        return {}
    files = saved.get("files")
    return files if isinstance(files, dict) else {}


def _write_stamp(stamp: Path, data: PreparedData, files: dict) -> None:
    try:
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_name(f"{stamp.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"path": str(data.path.resolve()), "fingerprint": data.fingerprint,
                                   "files": files}))
        os.replace(tmp, stamp)
        _prune_stamps(stamp.parent)
    except OSError:
        pass  # no writable cache: the next open hashes again


def _prune_stamps(folder: Path) -> None:
    """Forget datasets that no longer exist, so the stamps stay as many as the datasets on this machine."""
    for p in folder.glob("*.json"):
        try:
            if not Path(json.loads(p.read_text())["path"]).exists():
                p.unlink()
                p.with_suffix(".lock").unlink(missing_ok=True)
        except (OSError, ValueError, KeyError, TypeError):
            continue


def verify_hashes(data: PreparedData) -> None:
    """Check every file's sha256 against the manifest, once per file on this machine.

    A file whose (size, mtime, inode) were seen with the right hash before is not read again: the
    stamp lives under `cache_root()/verified/`. So the first open of a dataset on a node reads it all
    (about a second per GB), and later opens, by every rank and every restart, only stat the files.
    The ranks of a node take a lock, so one of them hashes while the others wait for its stamp.
    As in git's index, a file modified less than RACY_NS before it was hashed is not stamped (a
    change within the same timestamp tick would keep its mtime). A change in place that keeps
    size, mtime and inode is not seen: the check is against a wrong, partial or replaced file, not
    against later bit rot.
    """
    folder = data._local()
    stamp = _stamp_path(folder)
    with _locked(stamp.with_suffix(".lock")):
        known = _read_stamp(stamp, data)
        fresh = {}
        for name, _, sha in _files(data.manifest):
            key = _file_key(folder / name)
            if known.get(name) != [*key, sha]:
                got = file_sha256(folder / name)
                if got != sha:
                    raise DataError(_hash_mismatch(str(folder / name), got, sha))
                if key[1] > time.time_ns() - RACY_NS:
                    continue  # hashed, but too fresh to vouch for later
            fresh[name] = [*key, sha]
        if fresh != known:
            _write_stamp(stamp, data, fresh)


def record_verified(data: PreparedData) -> None:
    """Stamp every file of `data` as verified: for a writer that hashed the bytes as it wrote them
    (`ray_jobs.prepare`, the copy of remote data), so that the first open does not read them again."""
    folder = data._local()
    stamp = _stamp_path(folder)
    with _locked(stamp.with_suffix(".lock")):
        _write_stamp(stamp, data, {name: [*_file_key(folder / name), sha] for name, _, sha in _files(data.manifest)})


# ---- remote data: one verified copy per node ------------------------------------------------------

def _remote_fs(uri: str):
    import pyarrow.fs as pafs

    try:
        fs, root = pafs.FileSystem.from_uri(uri)
    except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError
        raise DataError(f"cannot open {uri}: {e}") from None
    return fs, root.rstrip("/")


def _open_remote(uri: str) -> PreparedData:
    import pyarrow.fs as pafs

    uri = uri.rstrip("/")
    fs, root = _remote_fs(uri)
    try:
        if fs.get_file_info(f"{root}/{MANIFEST}").type == pafs.FileType.NotFound:
            raise DataError(f"{uri} has no {MANIFEST}: not a prepared dataset, or its prepare did not finish")
        with fs.open_input_stream(f"{root}/{MANIFEST}") as f:
            raw = f.read()
        manifest = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{uri}/{MANIFEST} is not valid JSON ({e})") from None
    except OSError as e:
        raise DataError(f"cannot read {uri}/{MANIFEST}: {e}") from None
    check_manifest(manifest, f"{uri}/{MANIFEST}")
    files = _files(manifest)
    try:
        infos = fs.get_file_info([f"{root}/{name}" for name, _, _ in files])
    except OSError as e:
        raise DataError(f"cannot list {uri}: {e}") from None
    for (name, size, _), info in zip(files, infos, strict=True):
        if info.type == pafs.FileType.NotFound:
            raise DataError(f"{uri}: {name} listed in {MANIFEST} is missing")
        if size is not None and info.size != size:
            raise DataError(_size_message(f"{uri}/{name}", info.size, size))
    return PreparedData(None, manifest, uri=uri)


def open_local(data: str | os.PathLike) -> PreparedData:
    """`open_prepared` for a local folder; for a remote URI, the node-local copy (made once, then reused).

    The copy goes to `cache_root()/data/<fingerprint>`: written into a temporary folder, every file
    hashed as it arrives and checked against the manifest, the manifest last, then renamed into
    place, under a lock, so the ranks of a node make one copy between them and a later run (a
    restart, a resume, another job on the same data) finds it ready.
    """
    if not is_remote(data):
        return open_prepared(data)
    return materialise(_open_remote(str(data)))


def materialise(remote: PreparedData, cache: Path | None = None) -> PreparedData:
    """The verified local copy of `remote` (from `open_prepared(uri)`), copying it if this node lacks it."""
    cache = (cache or cache_root()) / "data"
    target = cache / remote.fingerprint[:32]
    with _locked(cache / f"{target.name}.lock"):
        if (target / MANIFEST).is_file():
            try:
                local = open_prepared(target)
                if local.fingerprint == remote.fingerprint:
                    return local
            except DataError:
                pass  # a damaged copy: make it again
            shutil.rmtree(target)
        for stale in cache.glob(f"{target.name}.tmp-*"):  # left by a killed copier (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        _check_space(cache, remote)
        tmp = cache / f"{target.name}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        try:
            fs, root = _remote_fs(remote.uri)
            for name, size, sha in _files(remote.manifest):
                _copy_verified(fs, f"{root}/{name}", tmp / name, size, sha, f"{remote.uri}/{name}")
            _write_synced(tmp / MANIFEST, json.dumps(remote.manifest, indent=2).encode())
            _fsync_dir(tmp)
            os.rename(tmp, target)
            _fsync_dir(cache)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        local = PreparedData(target, remote.manifest)
        record_verified(local)
    return open_prepared(target)


def _check_space(cache: Path, remote: PreparedData) -> None:
    cache.mkdir(parents=True, exist_ok=True)
    need = remote.num_bytes + (1 << 20)
    free = shutil.disk_usage(cache).free
    if free < need:
        raise DataError(f"copying {remote.uri} ({need / 1e9:.2f} GB) to this node needs that much free space in "
                        f"{cache}, which has {free / 1e9:.2f} GB free (set MINILM_CACHE to a larger disk)")


def _copy_verified(fs, src: str, dst: Path, size: int | None, sha: str, where: str) -> None:
    h, copied = hashlib.sha256(), 0
    try:
        with fs.open_input_stream(src) as f, open(dst, "wb") as out:
            while chunk := f.read(COPY_CHUNK):
                h.update(chunk)
                out.write(chunk)
                copied += len(chunk)
            out.flush()
            os.fsync(out.fileno())
    except OSError as e:
        raise DataError(f"copying {where} to this node failed: {e}") from None
    if size is not None and copied != size:
        raise DataError(_size_message(where, copied, size))
    if h.hexdigest() != sha:
        raise DataError(_hash_mismatch(where, h.hexdigest(), sha))


def _write_synced(path: Path, payload: bytes) -> None:
    with open(path, "wb") as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# ---- reading rows ---------------------------------------------------------------------------------

class SequenceStore:
    """Rows by sample id, read from the token files with positional reads; nothing is cached here.

    Each `take` reads just the rows asked for (adjacent ones in one read) into a fresh array; the
    files' pages stay in the kernel's page cache, shared by every process on the node, and count
    toward no process's RSS. File descriptors are opened on first use (at most MAX_OPEN_SHARDS
    stay open) with readahead off: rows are read at random positions.
    """

    def __init__(self, data: PreparedData):
        self.data = data
        self._paths = data.shard_paths
        self._starts = np.array([int(s["first_sample_id"]) for s in data.manifest["shards"]], dtype=np.int64)
        self._dtype = data.token_dtype
        self._row_len = data.seq_len + 1
        self._row_bytes = self._row_len * self._dtype.itemsize
        self._fds: OrderedDict[int, int] = OrderedDict()

    def _fd(self, shard: int) -> int:
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd
        try:
            fd = os.open(self._paths[shard], os.O_RDONLY)
        except FileNotFoundError:
            raise DataError(f"{self._paths[shard]}: token file is missing (it was there when the data was "
                            f"opened)") from None
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        self._fds[shard] = fd
        if len(self._fds) > MAX_OPEN_SHARDS:
            os.close(self._fds.popitem(last=False)[1])
        return fd

    def _read(self, shard: int, first_row: int, out: np.ndarray) -> None:
        view = memoryview(out).cast("B")
        offset, done = first_row * self._row_bytes, 0
        while done < len(view):
            n = os.preadv(self._fd(shard), [view[done:]], offset + done)
            if n == 0:
                raise DataError(f"{self._paths[shard]}: ends before row {first_row + len(out)} (truncated since "
                                f"the data was opened)")
            done += n

    def take(self, sample_ids: np.ndarray) -> np.ndarray:
        """Rows for `sample_ids`, in that order: (len(sample_ids), seq_len + 1) int32."""
        sample_ids = np.asarray(sample_ids, dtype=np.int64)
        if len(sample_ids) and (sample_ids.min() < 0 or sample_ids.max() >= self.data.num_sequences):
            raise DataError(f"{self.data.location}: sample ids must be in [0, {self.data.num_sequences}), got "
                            f"{sample_ids.min()}..{sample_ids.max()}")
        raw = np.empty((len(sample_ids), self._row_len), dtype=self._dtype)
        if len(sample_ids):
            order = np.argsort(sample_ids, kind="stable")
            ids = sample_ids[order]
            shard = np.searchsorted(self._starts, ids, side="right") - 1
            # runs of consecutive ids in one shard are read with one call
            cuts = np.flatnonzero((np.diff(ids) != 1) | (np.diff(shard) != 0)) + 1
            for a, b in zip(np.r_[0, cuts], np.r_[cuts, len(ids)], strict=True):
                dst = order[a:b]
                row = int(ids[a] - self._starts[shard[a]])
                if dst[-1] - dst[0] == b - a - 1 and (b - a == 1 or np.all(np.diff(dst) == 1)):
                    self._read(int(shard[a]), row, raw[dst[0]:dst[0] + b - a])  # already in place
                else:
                    rows = np.empty((b - a, self._row_len), dtype=self._dtype)
                    self._read(int(shard[a]), row, rows)
                    raw[dst] = rows
        return raw.astype(np.int32)

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popitem()[1])

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self):  # a store sent to another process opens its own files there
        return {k: v for k, v in self.__dict__.items() if k != "_fds"}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fds = OrderedDict()


# ---- the order ------------------------------------------------------------------------------------

def split_ids(num_sequences: int, val_samples: int) -> tuple[np.ndarray, np.ndarray]:
    """(train_ids, val_ids): a fixed held-out slice, disjoint from training, same for every seed."""
    if val_samples < 0 or val_samples >= num_sequences:
        raise DataError(f"val_samples {val_samples} must be in [0, {num_sequences}) for a dataset of "
                        f"{num_sequences} sequences")
    rng = np.random.default_rng(VAL_SEED)
    val = np.sort(rng.choice(num_sequences, size=val_samples, replace=False)) if val_samples else np.array([], np.int64)
    mask = np.ones(num_sequences, dtype=bool)
    mask[val] = False
    return np.flatnonzero(mask).astype(np.int64), val.astype(np.int64)


def epoch_order(train_ids: np.ndarray, seed: int, epoch: int) -> np.ndarray:
    """The training ids in this epoch's order: a permutation seeded by (seed, epoch)."""
    rng = np.random.default_rng([seed, epoch])
    return train_ids[rng.permutation(len(train_ids))]


def steps_per_epoch(num_train: int, global_batch_size: int) -> int:
    """Whole global batches per epoch; the remainder (< one batch) waits for the next epoch's order."""
    return num_train // global_batch_size


@dataclass
class DataPosition:
    """Where the run is in its data, derived from the optimizer step alone."""

    epoch: int
    step_in_epoch: int
    samples_seen: int

    @classmethod
    def at(cls, optimizer_step: int, steps_per_epoch: int, global_batch_size: int) -> DataPosition:
        return cls(epoch=optimizer_step // steps_per_epoch, step_in_epoch=optimizer_step % steps_per_epoch,
                   samples_seen=optimizer_step * global_batch_size)


@dataclass
class RankOrder:
    """The sample id at each position of one rank's stream that starts at optimizer step `start_step`.

    Position p belongs to optimizer step s = start_step + p // (G/W), as its k-th id, k = p % (G/W):
    the id at index (s mod steps_per_epoch) * G + rank * G/W + k of epoch (s // steps_per_epoch)'s
    order. The Ray stream (`ray_jobs.stream`) and the in-process stream (`LocalRankStream`) both
    read through it, so the order is coded once.
    """

    train_ids: np.ndarray
    seed: int
    steps_per_epoch: int
    global_batch_size: int
    world_size: int
    rank: int
    start_step: int

    def __post_init__(self):
        self._orders: dict[int, np.ndarray] = {}

    def sample_ids(self, positions: np.ndarray) -> np.ndarray:
        per_rank = self.global_batch_size // self.world_size
        absolute = self.start_step * per_rank + np.asarray(positions, dtype=np.int64)
        step, k = absolute // per_rank, absolute % per_rank
        epoch, step_in_epoch = step // self.steps_per_epoch, step % self.steps_per_epoch
        index = step_in_epoch * self.global_batch_size + self.rank * per_rank + k  # into the epoch's order
        out = np.empty(len(absolute), dtype=np.int64)
        for e in np.unique(epoch):
            selected = epoch == e
            out[selected] = self._order(int(e))[index[selected]]
        return out

    def _order(self, epoch: int) -> np.ndarray:
        if epoch not in self._orders:
            if len(self._orders) >= 2:  # a batch spans at most two epochs
                self._orders.pop(min(self._orders))
            self._orders[epoch] = epoch_order(self.train_ids, self.seed, epoch)
        return self._orders[epoch]


class LocalRankStream:
    """One rank's micro-batches read in this process (no Ray): `python -m minilm.train`, torchrun, tests.

    The same interface as the Ray stream (`ray_jobs.stream.RankStream`): `next_step()` returns the
    accumulation_steps micro-batches of the next optimizer step, on `device`, and the sample ids
    they hold (a host array: no device round trip); `data_wait_s` is the time spent reading.
    `store` is anything with `take(sample_ids) -> (n, seq_len + 1) array` (a `SequenceStore`, or rows
    held in memory).
    """

    def __init__(self, store, order: RankOrder, micro_batch_size: int, device="cpu"):
        import torch

        self.store, self.order, self.m, self.device = store, order, micro_batch_size, torch.device(device)
        self.per_rank = order.global_batch_size // order.world_size
        self.position = 0
        self.data_wait_s = 0.0

    def next_step(self):
        import torch

        t0 = time.perf_counter()
        ids = self.order.sample_ids(np.arange(self.position, self.position + self.per_rank))
        self.position += self.per_rank
        rows = torch.from_numpy(np.ascontiguousarray(self.store.take(ids)))
        batches = [chunk.to(self.device, non_blocking=True).long() for chunk in rows.split(self.m)]
        self.data_wait_s += time.perf_counter() - t0
        return batches, ids


class RowsInMemory:
    """Rows held in memory, read by sample id like a `SequenceStore` (tests, benchmarks, `--tokens`)."""

    def __init__(self, rows):
        self.rows = np.asarray(rows)

    def take(self, sample_ids: np.ndarray) -> np.ndarray:
        return self.rows[np.asarray(sample_ids, dtype=np.int64)]
