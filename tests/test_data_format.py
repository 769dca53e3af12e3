"""The prepared-data format on disk: rows by sample id, every kind of damage refused with one clear
error, verification once per machine, v1 data refused with the command that prepares it again, and
remote data (a file:// URI through pyarrow.fs) copied once per node, verified. No Ray."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, error_lines, make_prepared, matches, reference_rows, run_module

from minilm import data as D
from minilm.data import remote as data_remote
from minilm.data import store as data_store
from minilm.data import verified as data_verified

SEQ = 16


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """Each test its own MINILM_CACHE (verification stamps, copies of remote data)."""
    monkeypatch.setenv("MINILM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def dataset(tmp_path: Path, name: str = "tok", *, num_sequences: int = 50, rows_per_shard: int = 20) -> Path:
    out = make_prepared(tmp_path / name, num_sequences=num_sequences, seq_len=SEQ, vocab_size=300,
                        rows_per_shard=rows_per_shard)
    for f in out.iterdir():  # written long ago: old enough for a verification stamp
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns - 10**10))
    return out


def one_line(e: pytest.ExceptionInfo) -> str:
    message = str(e.value)
    assert "\n" not in message
    return message


# ---- reading rows ----------------------------------------------------------------------------------

def test_rows_by_sample_id_in_any_order(tmp_path):
    path = dataset(tmp_path, num_sequences=95, rows_per_shard=20)
    rows = reference_rows(path)
    store = D.SequenceStore(D.open_prepared(path))
    rng = np.random.default_rng(0)
    for ids in (np.arange(95), rng.permutation(95), np.array([19, 20, 21, 21, 0, 94, 3]), np.array([], np.int64),
                np.arange(18, 43), np.arange(43, 18, -1)):
        got = store.take(ids)
        assert got.dtype == np.int32 and got.shape == (len(ids), SEQ + 1)
        np.testing.assert_array_equal(got, rows[ids])
    with pytest.raises(D.DataError, match=r"sample ids must be in \[0, 95\)"):
        store.take(np.array([95]))


def test_store_keeps_a_bounded_number_of_files_open(tmp_path, monkeypatch):
    path = dataset(tmp_path, num_sequences=60, rows_per_shard=5)  # 12 files
    monkeypatch.setattr(data_store, "MAX_OPEN_SHARDS", 3)
    store = D.SequenceStore(D.open_prepared(path))
    np.testing.assert_array_equal(store.take(np.arange(60)[::-1]), reference_rows(path)[::-1])
    assert len(store._fds) == 3
    store.close()
    assert not store._fds


# ---- damage: one clear error each -------------------------------------------------------------------

def flip_a_byte(path: Path) -> None:
    D.open_prepared(path)  # verified and stamped first: a later change is still found
    with open(path / "shard-00000.bin", "r+b") as f:  # same size, one byte changed
        f.seek(7)
        byte = f.read(1)
        f.seek(7)
        f.write(bytes([byte[0] ^ 1]))


def truncate(path: Path) -> None:
    with open(path / "shard-00002.bin", "r+b") as f:
        f.truncate(100)


def manifest(change):
    def edit_manifest(path: Path) -> None:
        m = json.loads((path / "manifest.json").read_text())
        change(m)
        (path / "manifest.json").write_text(json.dumps(m))
    return edit_manifest


# (damage done to a fresh dataset at {path}, the one-line message: "…" stands for any text)
DAMAGE = [
    (lambda path: (path / "shard-00001.bin").unlink(),
     "{path}: token file shard-00001.bin listed in manifest.json is missing"),
    (truncate, "{path}/shard-00002.bin holds 100 bytes but manifest.json lists 340 (truncated, or not this "
               "dataset's file)…"),
    (flip_a_byte, "…shard-00000.bin: sha256 …does not match manifest.json's…"),
    (manifest(lambda m: m["shards"][1].update(bytes=1000)),
     "…shard shard-00001.bin lists 1,000 bytes, but 20 rows of seq_len + 1 = 17 uint16 tokens take 680…"),
    # a manifest consistent with itself that lists more rows than the file holds
    (manifest(lambda m: (m["shards"][-1].update(num_sequences=11, bytes=11 * 34), m.update(num_sequences=51))),
     "…shard-00002.bin holds 340 bytes but manifest.json lists 374 (truncated…"),
    (lambda path: (path / "manifest.json").write_text(json.dumps({"format": "minilm-packed-v1", "seq_len": 512,
                                                                 "num_sequences": 3, "shards": [], "fingerprint": "f"})),
     "{path}/manifest.json: format 'minilm-packed-v1' is not 'minilm-packed-v2'"),
    *[(manifest(change), f"…{needle}…") for change, needle in [
        (lambda m: m.update(token_dtype="int8"), "token_dtype 'int8' is not one of uint16, uint32"),
        (lambda m: m["tokenizer"].update(vocab_size=70000), "token_dtype uint16 cannot hold the ids of a 70000-token"),
        (lambda m: m["shards"][1].update(first_sample_id=21), "starts at sample 21, expected 20"),
        (lambda m: m["shards"][0].update(file="../x.bin"), "shard file name '../x.bin' is not a safe name"),
        (lambda m: m["shards"][0].update(file="x\x00.bin"), "shard file name 'x\\x00.bin' is not a safe name"),
        (lambda m: m.update(fingerprint="../../../.ssh"), "fingerprint '../../../.ssh' is not a safe name"),
        (lambda m: m.update(seq_len=1e400), "malformed (OverflowError"),
        (lambda m: m.update(num_sequences=49), "shard sizes do not add up to num_sequences 49"),
        (lambda m: m.pop("token_dtype"), "missing token_dtype"),
        (lambda m: m.update(shards=[1, 2]), "malformed (TypeError")]],
]


@pytest.mark.parametrize("damage, message", DAMAGE)
def test_damaged_data_is_one_clear_error(tmp_path, damage, message):
    path = dataset(tmp_path)
    damage(path)
    with pytest.raises(D.DataError) as e:
        D.open_prepared(path)
    assert matches(one_line(e), message.replace("{path}", str(path))), str(e.value)


def test_pretrain_refuses_damaged_data_before_it_starts(tmp_path):
    """The driver's check, through the real command line: exit 2, one error line, no Ray started."""
    path = dataset(tmp_path)
    with open(path / "shard-00001.bin", "r+b") as f:
        f.seek(3)
        f.write(b"\xff")
    proc = run_module("ray_jobs.pretrain", ["--data", str(path), "--seq-len", str(SEQ), "--vocab-size", "300"],
                      env={**os.environ, "RAY_ADDRESS": ""}, timeout=120)
    assert proc.returncode == 2, proc.stderr
    errors = error_lines(proc.stderr)
    assert len(errors) == 1 and "shard-00001.bin: sha256" in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Started a local Ray" not in proc.stderr + proc.stdout


# ---- verification once per machine ----------------------------------------------------------------

def test_files_are_hashed_once_per_machine(tmp_path, monkeypatch):
    path = dataset(tmp_path)
    hashed = []
    real = D.file_sha256
    monkeypatch.setattr(data_verified, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    D.open_prepared(path)
    assert sorted(hashed) == ["shard-00000.bin", "shard-00001.bin", "shard-00002.bin", "tokenizer.json"]
    hashed.clear()
    D.open_prepared(path)
    assert hashed == []  # the stamp vouches for files that have not changed
    (path / "shard-00001.bin").write_bytes((path / "shard-00001.bin").read_bytes())  # rewritten: a new mtime
    D.open_prepared(path)
    D.open_prepared(path)
    assert hashed == ["shard-00001.bin", "shard-00001.bin"]  # and too fresh to stamp: hashed until it is older
    D.open_prepared(path, verify=False)
    assert hashed == ["shard-00001.bin", "shard-00001.bin"]


def test_stamps_of_deleted_datasets_are_forgotten(tmp_path, cache):
    a, b = dataset(tmp_path, "a"), dataset(tmp_path, "b")
    D.open_prepared(a)
    shutil.rmtree(a)
    D.open_prepared(b)
    stamps = [json.loads(p.read_text())["path"] for p in (cache / "verified").glob("*.json")]
    assert stamps == [str(b.resolve())]


# ---- remote data --------------------------------------------------------------------------------------

def test_remote_uri_is_read_remotely_and_copied_once(tmp_path, cache, monkeypatch):
    path = dataset(tmp_path)
    uri = f"file://{path}"
    remote = D.open_prepared(uri)
    assert remote.path is None and remote.uri == uri and remote.num_sequences == 50 and remote.seq_len == SEQ
    assert remote.fingerprint == json.loads((path / "manifest.json").read_text())["fingerprint"]
    with pytest.raises(D.DataError, match="is remote: read it through minilm.data.open_local"):
        _ = remote.tokenizer_path
    copies = []
    real = D._copy_verified
    monkeypatch.setattr(data_remote, "_copy_verified", lambda *a: copies.append(a[2].name) or real(*a))
    local = D.open_local(uri)
    assert local.path == cache / "data" / remote.fingerprint[:32] and local.fingerprint == remote.fingerprint
    assert sorted(copies) == ["shard-00000.bin", "shard-00001.bin", "shard-00002.bin", "tokenizer.json"]
    np.testing.assert_array_equal(D.SequenceStore(local).take(np.arange(50)), reference_rows(path))
    assert D.open_local(uri).path == local.path and len(copies) == 4  # reused, not copied again
    assert sorted(p.name for p in (cache / "data").iterdir()) == [local.path.name, local.path.name + ".lock"]
    assert D.open_local(str(path)).path == path  # a local path is used where it is


def test_damaged_copy_is_made_again(tmp_path):
    path = dataset(tmp_path)
    local = D.open_local(f"file://{path}")
    (local.path / "shard-00001.bin").unlink()
    again = D.open_local(f"file://{path}")
    np.testing.assert_array_equal(D.SequenceStore(again).take(np.arange(50)), reference_rows(path))


def test_remote_file_that_fails_its_hash_is_not_kept(tmp_path, cache):
    path = dataset(tmp_path)
    data = bytearray((path / "shard-00002.bin").read_bytes())
    data[5] ^= 0xFF
    (path / "shard-00002.bin").write_bytes(bytes(data))
    with pytest.raises(D.DataError) as e:
        D.open_local(f"file://{path}")
    assert f"file://{path}/shard-00002.bin: sha256 " in one_line(e)
    assert sorted(p.name for p in (cache / "data").iterdir()) == [f"{D.open_prepared(f'file://{path}').fingerprint[:32]}.lock"]


def test_remote_damage_is_found_before_copying(tmp_path):
    path = dataset(tmp_path)
    with open(path / "shard-00001.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(D.DataError, match=r"shard-00001.bin holds 10 bytes but manifest.json lists 680"):
        D.open_prepared(f"file://{path}")
    (path / "shard-00001.bin").unlink()
    with pytest.raises(D.DataError, match=r"shard-00001.bin listed in manifest.json is missing"):
        D.open_prepared(f"file://{path}")
    with pytest.raises(D.DataError, match="has no manifest.json"):
        D.open_prepared(f"file://{tmp_path}/nothing-here")
    with pytest.raises(D.DataError, match="cannot open nosuchscheme://bucket/data"):
        D.open_prepared("nosuchscheme://bucket/data")


def test_not_enough_space_for_the_copy(tmp_path, monkeypatch):
    path = dataset(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: namedtuple("u", "total used free")(10**9, 10**9, 1000))
    with pytest.raises(D.DataError, match=r"needs that much free space in .*cache/data, which has 0.00 GB free "
                                          r"\(set MINILM_CACHE to a larger disk\)"):
        D.open_local(f"file://{path}")


COPY_AND_COUNT = """
import os, sys
from minilm import data as D
from minilm.data import remote
real = remote._copy_verified
def counted(*args):
    with open(sys.argv[2], "a") as f:
        f.write(f"{os.getpid()} {args[2].name}\\n")
    return real(*args)
remote._copy_verified = counted
print(D.open_local(sys.argv[1]).path)
"""


def test_the_ranks_of_a_node_make_one_copy_between_them(tmp_path):
    """Two processes open the same remote data at once: one copies it, the other waits and reuses it."""
    path = dataset(tmp_path, num_sequences=400, rows_per_shard=50)
    log = tmp_path / "copies.log"
    procs = [subprocess.Popen([sys.executable, "-c", COPY_AND_COUNT, f"file://{path}", str(log)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    paths = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(paths) == 1
    lines = log.read_text().splitlines()
    assert len(lines) == 9 and len({line.split()[0] for line in lines}) == 1  # 8 shards + tokenizer, one process


@pytest.mark.ray
@pytest.mark.slow  # prepares the demo corpus (~11 s)
def test_cached_demo_data_of_another_format_is_prepared_again(ray_address, cache):
    """A cached copy of the built-in corpus that does not open (here: another format) is prepared again."""
    from ray_jobs.demo_data import demo_data_dir

    old = cache / "demo" / f"py{sys.version_info.major}{sys.version_info.minor}-seq64-vocab300-best-fit"
    old.mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"format": "minilm-packed-v1", "seq_len": 64, "num_sequences": 1,
                                                   "shards": [], "fingerprint": "f", "command": "x"}))
    assert demo_data_dir(64, 300) == old
    new = D.open_prepared(old)
    assert new.manifest["format"] == "minilm-packed-v2" and new.num_sequences > 100
    assert new.manifest["rows"] == "best-fit"  # the default format, which the cache's name carries
    assert sorted(p.name for p in old.iterdir()) == ["manifest.json", "shard-00000.bin", "tokenizer.json"]
