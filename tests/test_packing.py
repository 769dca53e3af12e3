"""Packing documents into rows, the shard files, the manifest and the atomic output folder (no Ray)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minilm import fsio
from minilm import packing as P
from minilm import rows as R
from minilm.data import DataError, SequenceStore, file_sha256, open_prepared

EOS = 2
docs_strategy = st.lists(st.lists(st.integers(3, 299), min_size=0, max_size=40), min_size=0, max_size=30)


def stream_of(docs):
    out = []
    for d in docs:
        out += list(d) + [EOS]
    return out


@settings(max_examples=200, deadline=None)
@given(docs=docs_strategy, seq_len=st.integers(1, 20))
def test_pack_documents_keeps_every_token_in_order(docs, seq_len):
    rows, dropped = R.pack_documents(docs, seq_len)
    stream = stream_of(docs)
    assert rows.shape == (len(stream) // (seq_len + 1), seq_len + 1)
    assert rows.dtype == np.int32
    assert dropped == len(stream) % (seq_len + 1)
    assert rows.reshape(-1).tolist() + stream[len(stream) - dropped:] == stream


def write_dataset(directory, docs, seq_len, rows_per_shard, by_stream=False):
    w = P.ShardWriter(directory, seq_len, rows_per_shard)
    if by_stream:  # the pipeline's path: EOS already in the stream, any chunking
        stream = np.array(stream_of(docs), np.int32)
        for chunk in np.array_split(stream, 7):
            w.add_stream(chunk)
        w.result.documents = len(docs)
    else:
        for d in docs:
            w.add_document(d)
    result = w.close()
    (directory / P.TOKENIZER_FILE).write_text("{}")
    manifest = P.build_manifest(
        result, tokenizer={"path": P.TOKENIZER_FILE, "source": "test", "sha256": file_sha256(directory / P.TOKENIZER_FILE),
                           "vocab_size": 300,
                           "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
        inputs=[], documents_read=len(docs), documents_skipped=0, skipped_by_reason={}, command="test")
    P.write_manifest(directory, manifest)
    return manifest


@settings(max_examples=25, deadline=None)
@given(docs=docs_strategy, seq_len=st.integers(1, 12), rows_per_shard=st.integers(1, 5),
       by_stream=st.booleans())
def test_shards_hold_exactly_the_packed_rows(tmp_path_factory, docs, seq_len, rows_per_shard, by_stream):
    d = tmp_path_factory.mktemp("ds")
    rows, dropped = R.pack_documents(docs, seq_len)
    m = write_dataset(d, docs, seq_len, rows_per_shard, by_stream=by_stream)
    assert m["num_sequences"] == len(rows)
    assert m["num_tokens"] == len(rows) * (seq_len + 1)
    assert m["dropped_tail_tokens"] == dropped
    assert len(m["shards"]) == -(-len(rows) // rows_per_shard)
    assert all(s["num_sequences"] == rows_per_shard for s in m["shards"][:-1])
    if not len(rows):
        return
    data = open_prepared(d)
    got = SequenceStore(data).take(np.arange(data.num_sequences))
    np.testing.assert_array_equal(got, rows)
    # random access in any order
    order = np.random.default_rng(0).permutation(len(rows))
    np.testing.assert_array_equal(SequenceStore(data).take(order), rows[order])


def test_token_file_format(tmp_path):
    """Each shard is the raw little-endian rows, nothing else; the manifest lists its rows, bytes and hash."""
    rng = np.random.default_rng(1)
    docs = [rng.integers(3, 6400, rng.integers(0, 50)).tolist() for _ in range(200)]
    m = write_dataset(tmp_path, docs, 16, 64)
    rows, _ = R.pack_documents(docs, 16)
    assert m["token_dtype"] == "uint16"
    assert [s["file"] for s in m["shards"]] == [f"shard-{i:05d}.bin" for i in range(len(m["shards"]))]
    first = 0
    for s in m["shards"]:
        raw = (tmp_path / s["file"]).read_bytes()
        assert len(raw) == s["bytes"] == s["num_sequences"] * 17 * 2
        np.testing.assert_array_equal(np.frombuffer(raw, "<u2").reshape(-1, 17), rows[first:first + s["num_sequences"]])
        assert s["first_sample_id"] == first
        assert s["sha256"] == file_sha256(tmp_path / s["file"])
        first += s["num_sequences"]
    assert first == m["num_sequences"] == len(rows)


def test_uint32_tokens_for_a_large_vocabulary(tmp_path):
    rows = np.array([[70000, 5, 2], [3, 65536, 99999]])
    w = P.ShardWriter(tmp_path, 2, token_dtype="uint32")
    w.add_stream(rows.reshape(-1))
    result = w.close()
    assert result.token_dtype == "uint32" and result.shards[0]["bytes"] == 6 * 4
    np.testing.assert_array_equal(np.fromfile(tmp_path / "shard-00000.bin", "<u4").reshape(2, 3), rows)


def test_ids_that_do_not_fit_are_refused(tmp_path):
    w = P.ShardWriter(tmp_path, 4, token_dtype="uint16")
    with pytest.raises(ValueError, match="do not fit uint16"):
        w.add_stream(np.array([1, 2, 65536]))
    with pytest.raises(ValueError, match="do not fit uint16"):
        w.add_stream(np.array([-1, 2]))


def test_default_shards_hold_about_256_mb():
    assert P.default_rows_per_shard(512, "uint16") == (256 << 20) // (513 * 2)
    assert P.default_rows_per_shard(512, "uint32") == (256 << 20) // (513 * 4)


def test_same_rows_same_bytes(tmp_path):
    rng = np.random.default_rng(2)
    docs = [rng.integers(3, 300, rng.integers(1, 30)).tolist() for _ in range(300)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ma = write_dataset(tmp_path / "a", docs, 8, 100)
    mb = write_dataset(tmp_path / "b", docs, 8, 100, by_stream=True)
    for s in ma["shards"]:
        assert (tmp_path / "a" / s["file"]).read_bytes() == (tmp_path / "b" / s["file"]).read_bytes()
    assert ma["fingerprint"] == mb["fingerprint"]
    assert ma["shards"] == mb["shards"]


def test_fingerprint_depends_on_tokenizer_seq_len_shards_and_token_type():
    def fp(tok="a" * 64, seq_len=16, shards=("x", "y"), dtype="uint16"):
        return P.compute_fingerprint(tok, seq_len, list(shards), dtype)

    base = fp()
    assert base == fp()
    assert len({base, fp(tok="b" * 64), fp(seq_len=17), fp(shards=("y", "x")), fp(shards=("x",)),
                fp(dtype="uint32")}) == 6


def test_manifest_fields(tmp_path):
    m = write_dataset(tmp_path, [[5, 6, 7]] * 10, 3, 2)
    on_disk = json.loads((tmp_path / "manifest.json").read_text())
    assert on_disk == m
    for key in ("format", "seq_len", "token_dtype", "num_sequences", "num_tokens", "dropped_tail_tokens", "documents_read",
                "documents_skipped", "skipped_by_reason", "shards", "tokenizer", "inputs", "fingerprint",
                "command", "created_by"):
        assert key in m
    assert m["format"] == "minilm-packed-v2" and m["token_dtype"] == "uint16"
    assert m["num_sequences"] == 10 and m["dropped_tail_tokens"] == 0
    assert m["created_by"].startswith("minilm ")


def test_writer_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError):
        P.ShardWriter(tmp_path, 0)
    with pytest.raises(ValueError):
        P.ShardWriter(tmp_path, 4, rows_per_shard=0)


# ---- the atomic output folder --------------------------------------------------------------------------

def finished(out: P.AtomicOutput, docs=([5, 6, 7],) * 8):
    write_dataset(out.tmp, list(docs), 3, 4)
    return out.commit()


def test_atomic_output_appears_only_on_commit(tmp_path):
    final = tmp_path / "data" / "tok"
    out = P.AtomicOutput(final)
    assert out.tmp.parent == final.parent and out.tmp == fsio.staging_dir(final.parent, "tok")  # this host's, pid's
    write_dataset(out.tmp, [[5, 6, 7]] * 8, 3, 4)
    assert not final.exists()
    out.commit()
    out.abort()  # a no-op after commit
    assert open_prepared(final).num_sequences == 8
    assert sorted(p.name for p in final.parent.iterdir()) == ["tok"]


def test_atomic_output_abort_leaves_nothing(tmp_path):
    final = tmp_path / "tok"
    with P.AtomicOutput(final) as out:
        P.ShardWriter(out.tmp, 3, 2).add_document([4] * 20)
        (out.tmp / "shard-00009.bin").write_bytes(b"partial")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(DataError, match="does not exist"):
        open_prepared(final)


def test_incomplete_folder_is_refused_by_open_prepared(tmp_path):
    """What a crash before the rename would leave, were it renamed: shards, no manifest."""
    out = P.AtomicOutput(tmp_path / "tok")
    w = P.ShardWriter(out.tmp, 3, 2)
    for _ in range(10):
        w.add_document([5, 6, 7])
    w.close()
    with pytest.raises(DataError, match="no manifest.json"):
        open_prepared(out.tmp)
    with pytest.raises(RuntimeError, match="before the manifest"):
        out.commit()
    out.abort()


def test_existing_dataset_is_refused_unless_overwrite(tmp_path):
    final = tmp_path / "tok"
    finished(P.AtomicOutput(final))
    with pytest.raises(P.OutputError, match="already holds a prepared dataset.*--overwrite"):
        P.AtomicOutput(final)
    out = P.AtomicOutput(final, overwrite=True)
    assert open_prepared(final).num_sequences == 8  # the old one stays until commit
    finished(out, docs=([5, 6, 7],) * 12)
    assert open_prepared(final).num_sequences == 12
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


@pytest.mark.parametrize("incomplete", [False, True], ids=["empty-is-used", "incomplete-needs-overwrite"])
def test_an_empty_folder_is_used_and_an_incomplete_dataset_needs_overwrite(tmp_path, incomplete):
    final = tmp_path / "tok"
    final.mkdir()
    if incomplete:
        (final / "shard-00000.bin").write_bytes(b"x")
        with pytest.raises(P.OutputError, match="incomplete prepared dataset"):
            P.AtomicOutput(final)
    finished(P.AtomicOutput(final, overwrite=incomplete))
    assert open_prepared(final).num_sequences == 8


def test_foreign_folder_is_never_replaced(tmp_path):
    final = tmp_path / "mine"
    final.mkdir()
    (final / "notes.txt").write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(P.OutputError, match="other files"):
            P.AtomicOutput(final, overwrite=overwrite)
    assert (final / "notes.txt").read_text() == "precious"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(P.OutputError, match="not a directory"):
        P.AtomicOutput(tmp_path / "afile", overwrite=True)


def test_stale_temp_folders_are_removed(tmp_path):
    dead = fsio.staging_dir(tmp_path, "tok", 999999999)  # no such pid
    dead.mkdir()
    (dead / "shard-00000.parquet").write_bytes(b"x")
    alive = fsio.staging_dir(tmp_path, "tok", os.getppid())  # a live process: maybe another prepare
    alive.mkdir()
    other = tmp_path / "other.tmp-999999999"  # not a staging folder: the user's own
    elsewhere = tmp_path / f"{fsio.STAGING}elsewhere-999999999-tok"  # another host's: not ours to judge
    other.mkdir()
    elsewhere.mkdir()
    out = P.AtomicOutput(tmp_path / "tok")
    assert not dead.exists() and alive.exists() and other.exists() and elsewhere.exists()
    out.abort()
