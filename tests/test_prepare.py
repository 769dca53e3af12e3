"""`python -m ray_jobs.prepare`: inputs, bad records, determinism, atomicity.

Error paths are found while the driver reads, before Ray starts, so most of them run without Ray;
the tests that tokenize use one local Ray for the module (tests marked `ray`).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import ROOT, tree

from minilm import tokenizer as T
from minilm.data import DataError, SequenceStore, file_sha256, open_prepared
from minilm.fsio import staging_dir
from ray_jobs import prepare as PR
from ray_jobs import prepare_inputs as PI
from ray_jobs import prepare_pipeline as PP

SEQ = 16


def make_docs(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["the", "model", "packs", "tokens", "into", "rows", "of", "fixed", "length", "and", "every",
             "document", "ends", "with", "EOS", "数据", "训练", "模型", "😀", "🚀", "naïve", "café", "—", "42"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 60)))) + "." for _ in range(n)]


DOCS = make_docs(120)


def write_jsonl(path: Path, docs, field="text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({field: d, "id": 0}, ensure_ascii=False) + "\n")
    return path


def expected_rows(tok, docs, seq_len=SEQ):
    stream = []
    for d in docs:
        stream += tok.encode(d, add_special_tokens=False).ids + [2]
    n = len(stream) // (seq_len + 1)
    return np.array(stream[: n * (seq_len + 1)], np.int32).reshape(n, seq_len + 1), len(stream) - n * (seq_len + 1)


def read_all(out: Path) -> np.ndarray:
    data = open_prepared(out)
    return SequenceStore(data).take(np.arange(data.num_sequences))


def manifest_of(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    T.save_tokenizer(T.train_tokenizer(DOCS, 300), path)
    return path


@pytest.fixture(scope="module")
def tok(tok_path):
    return T.load_tokenizer(tok_path)


def prep(capsys, *args, code: int = 0) -> str:
    """Run the CLI in this process, check its exit status is `code`; its stderr.

    Without --rows, the packed layout: these tests check reading, sharding and hashing against rows that are
    easy to compute (`expected_rows`); the best-fit default and bos-aligned have tests of their own below.
    """
    args = [str(a) for a in args]
    if "--rows" not in args:
        args += ["--rows", "packed"]
    got = PR.main(args)
    err = capsys.readouterr().err
    assert got == code, err
    return err


def cli(*args, env=None, timeout=180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ray_jobs.prepare", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=env)


def assert_clean_error(err: str, *needles: str) -> None:
    assert "Traceback" not in err
    assert err.startswith("error: ") or "\nerror: " in err or ": error: " in err, err
    for n in needles:
        assert n in err, err


# ---- bad inputs, error mode (no Ray needed: the driver stops at the first bad record) -------------------

BAD_LINES = {
    "malformed_json": ('{"text": "a" "b"}', "malformed JSON (Expecting ',' delimiter at column 14)"),
    "not_an_object": ('["text", "a list"]', "a JSON list, not an object with 'text'"),
    "missing_text_field": ('{"content": "no text key"}', "no 'text' field (keys: content)"),
    "non_string_text": ('{"text": 17}', "'text' is int, not a string"),
    "null_text": ('{"text": null}', "'text' is null, not a string"),
    "lone_surrogate": ('{"text": "bad \\ud800 surrogate"}', "'text' holds a lone surrogate '\\ud800': not valid Unicode"),
}


def test_malformed_json_cli(tmp_path):
    """The real command line: exit status 2, file:line, the JSON error, no traceback."""
    src = tmp_path / "corpus.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:16]) + '{"text": "unterminated\n')
    r = cli("--input", src, "--output", tmp_path / "out", "--vocab-size", "300", "--seq-len", SEQ)
    assert r.returncode == 2
    assert_clean_error(r.stderr, "error: ", "corpus.jsonl:17: malformed JSON (Unterminated string")
    assert not (tmp_path / "out").exists()


def write_file(name: str, data: bytes | str):
    return lambda tmp: (tmp / name).write_bytes(data if isinstance(data, bytes) else data.encode())


def write_parquet(name: str, columns: dict):
    def write(tmp: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), tmp / name)
    return write


def write_datasets(name: str, *, splits: bool = False, damaged: bool = False):
    def write(tmp: Path) -> None:
        import datasets

        ds = datasets.Dataset.from_dict({"text": ["a"] if splits else ["a", "b"]})
        (datasets.DatasetDict({"train": ds}) if splits else ds).save_to_disk(tmp / name)
        for f in (tmp / name).glob("*.arrow") if damaged else ():
            f.unlink()
    return write


def write_all(*writers):
    return lambda tmp: [w(tmp) for w in writers]


# (case, what it writes into {tmp}, the inputs and flags, what stderr must say: its one error and any warnings)
INPUT_ERRORS = [
    ("utf8-jsonl", write_file("corpus.jsonl", b'{"text": "ok"}\n{"text": "caf\xe9"}\n'), ["{tmp}/corpus.jsonl"],
     ["corpus.jsonl:2: invalid UTF-8 (byte 0xe9 at column 14)"]),
    ("utf8-txt", write_file("notes.txt", b"line one\nline two\nbad \xff byte\n"), ["{tmp}/notes.txt"],
     ["notes.txt:3: invalid UTF-8 (byte 0xff at column 5)"]),
    ("empty-file", write_all(lambda tmp: write_jsonl(tmp / "a.jsonl", DOCS[:5]), write_file("b.jsonl", "\n\n")),
     ["{tmp}/a.jsonl", "{tmp}/b.jsonl"], ["b.jsonl: the input is empty (no records)"]),
    ("missing-path", lambda tmp: None, ["{tmp}/nope.jsonl"], ["nope.jsonl does not exist"]),
    ("no-glob-match", lambda tmp: None, ["{tmp}/*.jsonl"], ["no file matches this pattern"]),
    ("csv", write_file("data.csv", "text\nhello\n"), ["{tmp}/data.csv"], ["unsupported file type '.csv'"]),
    ("no-input-files", lambda tmp: ((tmp / "only").mkdir(), (tmp / "only" / "README.md").write_text("x")),
     ["{tmp}/only"], ["warning: ignoring 1 file(s) of unsupported type", "no input files found"]),
    ("no-usable-record", write_file("corpus.jsonl", '{"text": 1}\n{"txt": "x"}\nnot json\n{"text": ""}\n'),
     ["{tmp}/corpus.jsonl", "--on-bad-record", "skip"],
     ["the inputs hold no usable record (1 empty_text, 1 malformed_json, 1 missing_text_field, 1 non_string_text)",
      "warning: skipping ", "corpus.jsonl:3: malformed JSON"]),
    ("bad-tokenizer", write_all(lambda tmp: write_jsonl(tmp / "c.jsonl", DOCS[:5]), write_file("tok.json", "{}")),
     ["{tmp}/c.jsonl", "--tokenizer", "{tmp}/tok.json"], ["tok.json is not a tokenizers JSON file"]),
    ("missing-tokenizer", lambda tmp: write_jsonl(tmp / "c.jsonl", DOCS[:5]),
     ["{tmp}/c.jsonl", "--tokenizer", "{tmp}/no.json"], ["no.json does not exist"]),
    ("parquet-no-column", write_parquet("nocol.parquet", {"body": ["a", "b"]}), ["{tmp}/nocol.parquet"],
     ["nocol.parquet: row 1: no 'text' column (columns: body)"]),
    ("parquet-ints", write_parquet("ints.parquet", {"text": [1, 2]}), ["{tmp}/ints.parquet"],
     ["ints.parquet: row 1: column 'text' has type int64, not string"]),
    ("parquet-nulls", write_parquet("nulls.parquet", {"text": ["ok", None, "x"]}), ["{tmp}/nulls.parquet"],
     ["nulls.parquet: row 2: 'text' is null, not a string"]),
    ("parquet-junk", write_file("junk.parquet", b"not parquet at all"), ["{tmp}/junk.parquet"],
     ["junk.parquet: not a readable parquet file"]),
    ("dataset-dict", write_datasets("dd", splits=True), ["{tmp}/dd"],
     ["is a datasets DatasetDict (splits: train)", os.path.join("{tmp}", "dd", "train")]),
    ("damaged-datasets", write_datasets("ds", damaged=True), ["{tmp}/ds"], ["ds: cannot load the datasets folder"]),
    # a bad record among good ones: its file and line, and the way to skip such records
    *[(f"bad-record-{case}", write_file("corpus.jsonl", '{"text": "fine"}\n\n{"text": "also fine"}\n' + line +
                                        '\n{"text": "after"}\n'),
       ["{tmp}/corpus.jsonl", "--vocab-size", "300"], [f"corpus.jsonl:4: {message}", "--on-bad-record skip"])
      for case, (line, message) in BAD_LINES.items()],
]


@pytest.mark.parametrize("write, args, needles", [c[1:] for c in INPUT_ERRORS], ids=[c[0] for c in INPUT_ERRORS])
def test_bad_input_is_one_clear_error(capsys, tmp_path, write, args, needles):
    write(tmp_path)
    before = tree(tmp_path)
    inputs = [a.format(tmp=tmp_path) for a in args]
    err = prep(capsys, "--input", *inputs, "--output", tmp_path / "out", code=2)
    assert_clean_error(err, *[n.format(tmp=tmp_path) for n in needles])
    assert tree(tmp_path) == before  # no output, no temporary folder left behind


def test_existing_output_is_refused(capsys, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:5])
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"num_sequences": 3, "seq_len": 16, "fingerprint": "abc"}))
    err = prep(capsys, "--input", src, "--output", out, code=2)
    assert_clean_error(err, "already holds a prepared dataset", "pass --overwrite")
    (out / "manifest.json").unlink()
    (out / "mine.txt").write_text("keep me")
    err = prep(capsys, "--input", src, "--output", out, "--overwrite", code=2)
    assert_clean_error(err, "refusing to replace it")
    assert (out / "mine.txt").read_text() == "keep me"


# ---- reading inputs (no Ray) --------------------------------------------------------------------------

@pytest.fixture
def mixed_inputs(tmp_path):
    """A folder with every input kind, nested, plus things to ignore; returns (folder, docs in read order)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path / "corpus"
    docs = make_docs(60, seed=3)
    write_jsonl(root / "a.jsonl", docs[0:10])
    (root / "b.txt").write_text(docs[10] + "\n\n" + docs[11], encoding="utf-8")  # one document per file
    pq.write_table(pa.table({"text": docs[12:25], "n": list(range(13))}), root / "c.parquet", row_group_size=5)
    datasets.Dataset.from_dict({"text": docs[25:40]}).save_to_disk(str(root / "d_hf"))
    write_jsonl(root / "e" / "nested.jsonl", docs[40:50])
    (root / "e" / "z.txt").write_text(docs[50], encoding="utf-8")
    (root / ".hidden.jsonl").write_text('{"text": "hidden"}\n')
    (root / "README.md").write_text("ignored, with a warning")
    expected = docs[0:10] + [docs[10] + "\n\n" + docs[11]] + docs[12:40] + docs[40:50] + [docs[50]]
    return root, expected


def test_directory_walk_reads_every_format_in_sorted_order(mixed_inputs):
    root, expected = mixed_inputs
    warnings = []
    sources = PI.resolve_inputs([str(root)], warn=warnings.append)
    assert [(Path(s.display).relative_to(root).as_posix(), s.kind) for s in sources] == [
        ("a.jsonl", "jsonl"), ("b.txt", "txt"), ("c.parquet", "parquet"), ("d_hf", "hf"),
        ("e/nested.jsonl", "jsonl"), ("e/z.txt", "txt")]
    assert len(warnings) == 1 and "README.md" in warnings[0]
    reader = PI.RecordReader(sources, "text", "error")
    assert [t for t, _ in reader] == expected
    assert reader.documents == len(expected) and reader.documents_skipped == 0
    assert [c["documents"] for c in reader.per_source] == [10, 1, 13, 15, 10, 1]


def test_globs_and_repeats(mixed_inputs):
    root, _ = mixed_inputs
    warnings = []
    sources = PI.resolve_inputs([str(root / "**" / "*.jsonl"), str(root / "a.jsonl")], warn=warnings.append)
    assert [Path(s.display).name for s in sources] == ["a.jsonl", "nested.jsonl"]
    assert any("reading it once" in w for w in warnings)


def test_output_folder_is_not_read_as_input(tmp_path):
    write_jsonl(tmp_path / "in" / "a.jsonl", DOCS[:3])
    write_jsonl(tmp_path / "in" / "out" / "x.jsonl", DOCS[:3])
    write_jsonl(tmp_path / "in" / "out.tmp-123" / "x.jsonl", DOCS[:3])
    sources = PI.resolve_inputs([str(tmp_path / "in")], exclude=tmp_path / "in" / "out")
    assert [Path(s.display).name for s in sources] == ["a.jsonl"]


def test_text_field_and_bom(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + json.dumps({"content": "with a BOM"}).encode() + b"\r\n")
    reader = PI.RecordReader(PI.resolve_inputs([str(src)]), "content", "error")
    assert [t for t, _ in reader] == ["with a BOM"]


def test_progress_bar_only_on_a_terminal():
    """On a terminal, a tqdm bar of input bytes with documents and tokens; through a pipe, the messages alone."""
    class Tty(io.StringIO):
        def isatty(self):
            return True

    tty, pipe = Tty(), io.StringIO()
    for stream in (tty, pipe):
        p = PP.Progress(stream, interval=0)
        p.begin(2_000_000, "prepare")
        p.update(1_000_000, 1000, 250_000)
        p.message("warning: something")
        p.update(2_000_000, 2000, 500_000)
        p.done()
    shown = tty.getvalue()
    assert "prepare" in shown and "100%" in shown and "2.00M/2.00M" in shown and "2,000 docs, 500.0k tokens" in shown, shown
    assert "warning: something\n" in shown
    assert pipe.getvalue() == "warning: something\n"


def test_record_reader_counts_input_bytes(mixed_inputs):
    """The progress bar's measure: every input's bytes, once, whatever its format."""
    root, _ = mixed_inputs
    sources = PI.resolve_inputs([str(root)])
    reader = PI.RecordReader(sources, "text", "error")
    seen = []
    for _ in reader:
        seen.append(reader.input_bytes)
    assert seen == sorted(seen) and reader.input_bytes == sum(s.bytes for s in sources)


# ---- full runs (Ray) ----------------------------------------------------------------------------------

@pytest.mark.ray
def test_every_token_of_every_document_in_order(ray_address, capsys, tmp_path, tok, tok_path):
    src = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    out = tmp_path / "out"
    err = prep(capsys, "--input", src, "--output", out, "--tokenizer", tok_path, "--seq-len", SEQ,
               "--rows-per-shard", 7)
    rows, dropped = expected_rows(tok, DOCS)
    np.testing.assert_array_equal(read_all(out), rows)
    m = manifest_of(out)
    assert m["num_sequences"] == len(rows) and m["num_tokens"] == rows.size
    assert m["dropped_tail_tokens"] == dropped
    assert m["document_tokens"] == rows.size + dropped
    assert m["documents_read"] == len(DOCS) and m["documents_skipped"] == 0 and m["skipped_by_reason"] == {}
    assert len(m["shards"]) == -(-len(rows) // 7) and len(m["shards"]) > 2
    for s in m["shards"]:
        assert file_sha256(out / s["file"]) == s["sha256"]
    assert (out / "tokenizer.json").read_bytes() == tok_path.read_bytes()
    assert m["tokenizer"] == {"path": "tokenizer.json", "source": str(tok_path), "sha256": file_sha256(tok_path),
                              "vocab_size": 300, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    assert m["inputs"] == [{"path": str(src), "bytes": src.stat().st_size, "format": "jsonl",
                            "documents": len(DOCS), "skipped": 0}]
    assert m["seq_len"] == SEQ and m["format"] == "minilm-packed-v2" and m["token_dtype"] == "uint16"
    assert m["command"].startswith("python -m ray_jobs.prepare --input ")
    assert f"prepared {out}: {len(rows)} sequences of {SEQ}+1 tokens" in err
    assert "tokens/s" in err and "MB/s" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "out"]


@pytest.mark.ray
def test_same_input_same_bytes(ray_address, capsys, tmp_path, monkeypatch):
    src = write_jsonl(tmp_path / "corpus.jsonl", DOCS * 3)
    args = ["--input", src, "--seq-len", SEQ, "--rows-per-shard", 20, "--vocab-size", 300]
    prep(capsys, *args, "--output", tmp_path / "a")
    # other block sizes (many Ray tasks, some of one document) must not change a byte
    monkeypatch.setattr(PP, "BLOCK_BYTES", 3000)
    monkeypatch.setattr(PP, "BLOCK_DOCS", 7)
    prep(capsys, *args, "--output", tmp_path / "b")
    ma, mb = manifest_of(tmp_path / "a"), manifest_of(tmp_path / "b")
    assert ma["fingerprint"] == mb["fingerprint"]
    assert ma["shards"] == mb["shards"] and len(ma["shards"]) > 1
    for s in ma["shards"]:
        assert (tmp_path / "a" / s["file"]).read_bytes() == (tmp_path / "b" / s["file"]).read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    # the trained tokenizer is the one train_tokenizer makes from the same texts
    trained = T.tokenizer_to_str(T.train_tokenizer(DOCS * 3, 300))
    assert (tmp_path / "a" / "tokenizer.json").read_text(encoding="utf-8") == trained
    assert ma["tokenizer"]["source"] == "trained" and ma["tokenizer"]["vocab_size"] == 300


@pytest.mark.ray
def test_skip_mode_counts_every_reason(ray_address, capsys, tmp_path, tok, tok_path):
    good = DOCS[:40]
    lines = [json.dumps({"text": d}) for d in good]
    bad = ['{"text": "a" "b"}', '[1, 2]', '{"body": "x"}', '{"text": 3}', '{"text": null}',
           '{"text": "\\udc80"}', '{"text": ""}', '{broken']
    for i, b in enumerate(bad):
        lines.insert(3 + 4 * i, b)
    src = tmp_path / "corpus.jsonl"
    src.write_bytes(("\n".join(lines) + "\n").encode() + b'{"text": "\xff"}\n')
    (tmp_path / "empty.jsonl").write_text("")
    err = prep(capsys, "--input", src, tmp_path / "empty.jsonl", "--output", tmp_path / "out",
               "--tokenizer", tok_path, "--seq-len", SEQ, "--on-bad-record", "skip")
    m = manifest_of(tmp_path / "out")
    want = {"malformed_json": 2, "not_an_object": 1, "missing_text_field": 1, "non_string_text": 2,
            "invalid_utf8": 2, "empty_text": 1}
    assert m["skipped_by_reason"] == want
    assert m["documents_skipped"] == 9 and m["documents_read"] == len(good)
    assert m["empty_inputs"] == [str(tmp_path / "empty.jsonl")]
    assert [i["skipped"] for i in m["inputs"]] == [9, 0]
    assert "warning: skipping " + str(src) + ":4: malformed JSON" in err
    assert "warning: skipping " + str(tmp_path / "empty.jsonl") + ": the input is empty" in err
    assert ("skipped 9 record(s) (empty_text 1, invalid_utf8 2, malformed_json 2, missing_text_field 1, "
            "non_string_text 2, not_an_object 1, empty inputs 1)") in err
    rows, _ = expected_rows(tok, good)
    np.testing.assert_array_equal(read_all(tmp_path / "out"), rows)


@pytest.mark.ray
def test_every_input_format(ray_address, capsys, tmp_path, tok, tok_path, mixed_inputs):
    root, expected = mixed_inputs
    out = tmp_path / "out"
    err = prep(capsys, "--input", root, "--output", out, "--tokenizer", tok_path, "--seq-len", SEQ)
    assert "warning: ignoring 1 file(s) of unsupported type" in err
    m = manifest_of(out)
    assert [i["format"] for i in m["inputs"]] == ["jsonl", "txt", "parquet", "hf", "jsonl", "txt"]
    assert m["documents_read"] == len(expected)
    np.testing.assert_array_equal(read_all(out), expected_rows(tok, expected)[0])
    # a glob over the same files, and the files one by one, give the same dataset
    files = [root / "a.jsonl", root / "b.txt", root / "c.parquet", root / "d_hf", root / "e" / "nested.jsonl",
             root / "e" / "z.txt"]
    prep(capsys, "--input", *files, "--output", tmp_path / "one", "--tokenizer", tok_path, "--seq-len", SEQ)
    assert manifest_of(tmp_path / "one")["fingerprint"] == m["fingerprint"]
    err = prep(capsys, "--input", str(root / "*.jsonl"), str(root / "e" / "*"), "--output", tmp_path / "glob",
               "--tokenizer", tok_path, "--seq-len", SEQ)
    want = expected[:10] + expected[-11:]
    assert manifest_of(tmp_path / "glob")["documents_read"] == len(want)
    np.testing.assert_array_equal(read_all(tmp_path / "glob"), expected_rows(tok, want)[0])


@pytest.mark.ray
def test_text_field_option(ray_address, capsys, tmp_path, tok, tok_path):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:50], field="content")
    prep(capsys, "--input", src, "--output", tmp_path / "out", "--tokenizer", tok_path,
         "--seq-len", SEQ, "--text-field", "content")
    np.testing.assert_array_equal(read_all(tmp_path / "out"), expected_rows(tok, DOCS[:50])[0])


@pytest.mark.ray
def test_empty_text_is_skipped_and_counted_even_in_error_mode(ray_address, capsys, tmp_path, tok, tok_path):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS[:20] + [""] + DOCS[20:40])
    err = prep(capsys, "--input", src, "--output", tmp_path / "out", "--tokenizer", tok_path,
               "--seq-len", SEQ)
    m = manifest_of(tmp_path / "out")
    assert m["skipped_by_reason"] == {"empty_text": 1} and m["documents_read"] == 40
    assert "skipped 1 record(s) (empty_text 1)" in err
    assert f"warning: skipping {src}:21: 'text' is empty" in err
    np.testing.assert_array_equal(read_all(tmp_path / "out"), expected_rows(tok, DOCS[:40])[0])


@pytest.mark.ray
def test_too_little_text_for_one_sequence(ray_address, capsys, tmp_path, tok_path):
    src = write_jsonl(tmp_path / "c.jsonl", ["tiny"])
    err = prep(capsys, "--input", src, "--output", tmp_path / "out", "--tokenizer", tok_path,
               "--seq-len", 512, code=2)
    assert_clean_error(err, "fewer than one sequence of seq_len + 1 = 513")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


@pytest.mark.ray
def test_overwrite(ray_address, capsys, tmp_path, tok_path):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    args = ["--input", src, "--output", tmp_path / "out", "--tokenizer", tok_path, "--seq-len", SEQ]
    prep(capsys, *args)
    first = manifest_of(tmp_path / "out")
    err = prep(capsys, *args, code=2)
    assert_clean_error(err, "already holds a prepared dataset", "--overwrite")
    write_jsonl(src, DOCS[:60])
    prep(capsys, *args, "--overwrite")
    second = manifest_of(tmp_path / "out")
    assert second["documents_read"] == 60 and second["fingerprint"] != first["fingerprint"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out"]


# ---- atomicity ------------------------------------------------------------------------------------------

@pytest.mark.ray
def test_failure_midway_leaves_nothing(ray_address, capsys, tmp_path, tok_path, monkeypatch):
    import builtins

    src = write_jsonl(tmp_path / "c.jsonl", DOCS * 2)
    real = builtins.open
    calls = []

    def new_shard(path, mode):  # ShardWriter creates each token file with open(path, "xb")
        return mode == "xb" and Path(path).name.startswith("shard-")

    def failing(path, mode="r", *args, **kwargs):
        if new_shard(path, mode):
            calls.append(Path(path))
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", failing)
    args = PR.build_parser().parse_args(["--input", str(src), "--output", str(tmp_path / "out"), "--tokenizer",
                                         str(tok_path), "--seq-len", str(SEQ), "--rows-per-shard", "5"])
    with pytest.raises(OSError, match="No space left"):
        PR.run(args, [])
    assert len(calls) == 3 and calls[0].parent == staging_dir(tmp_path, "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
    with pytest.raises(DataError):
        open_prepared(tmp_path / "out")

    def interrupted(path, mode="r", *args, **kwargs):
        if new_shard(path, mode):
            raise KeyboardInterrupt
        return real(path, mode, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", interrupted)
    err = prep(capsys, "--input", src, "--output", tmp_path / "out", "--tokenizer", tok_path,
               "--seq-len", SEQ, code=130)
    assert "interrupted: nothing was written to" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def _start_and_wait_for_temp(tmp_path, src, tok_path, env):
    proc = subprocess.Popen([sys.executable, "-m", "ray_jobs.prepare", "--input", str(src), "--output",
                             str(tmp_path / "out"), "--tokenizer", str(tok_path), "--seq-len", str(SEQ)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    temp = staging_dir(tmp_path, "out", proc.pid)
    deadline = time.monotonic() + 60
    while not temp.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert temp.exists(), proc.communicate()
    return proc, temp


@pytest.mark.ray
def test_killed_prepare_leaves_no_dataset(ray_address, capsys, tmp_path, tok_path):
    """SIGTERM: the temp folder is removed; SIGKILL: it stays, is never DIR, and the next run clears it."""
    src = write_jsonl(tmp_path / "c.jsonl", DOCS * 20)
    env = {**os.environ, "RAY_ADDRESS": ray_address}

    proc, temp = _start_and_wait_for_temp(tmp_path, src, tok_path, env)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted: nothing was written to" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]

    proc, temp = _start_and_wait_for_temp(tmp_path, src, tok_path, env)
    proc.kill()
    proc.communicate(timeout=60)
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError):
        open_prepared(tmp_path / "out")
    with pytest.raises(DataError, match="no manifest.json"):
        open_prepared(temp)  # even the leftover is refused
    prep(capsys, "--input", src, "--output", tmp_path / "out", "--tokenizer", tok_path, "--seq-len", SEQ)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl", "out"]


@pytest.mark.ray
def test_cli_end_to_end(ray_address, tmp_path, tok_path):
    """The real command line, connecting to the running Ray through RAY_ADDRESS."""
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    r = cli("--input", src, "--output", tmp_path / "out", "--tokenizer", tok_path, "--seq-len", SEQ, env=env)
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"prepared {tmp_path / 'out'}: "), r.stderr  # one summary line
    assert open_prepared(tmp_path / "out").num_sequences == manifest_of(tmp_path / "out")["num_sequences"] > 0


@pytest.mark.ray
def test_default_rows_are_best_fit_rows_with_nothing_dropped(ray_address, tmp_path, tok_path, tok):
    """The real command line without --rows writes minilm.rows.best_fit_rows of the documents: every document
    from its BOS, long ones split into rows of their own, nothing cropped; the summary says so."""
    from minilm.rows import best_fit_rows

    seq = 31
    docs_text = DOCS + [" ".join(DOCS[:6])]  # one document longer than a row
    src = write_jsonl(tmp_path / "corpus.jsonl", docs_text)
    env = {**os.environ, "RAY_ADDRESS": ray_address}
    r = cli("--input", src, "--output", tmp_path / "out", "--seq-len", seq, "--tokenizer", tok_path, env=env)
    assert r.returncode == 0, r.stderr
    rows, m = read_all(tmp_path / "out"), manifest_of(tmp_path / "out")
    docs = [tok.encode(d, add_special_tokens=False).ids for d in docs_text]
    expected, fit = best_fit_rows(docs, seq + 1)
    assert np.array_equal(rows, expected) and rows[0][0] == 1
    assert m["rows"] == "best-fit" and m["best_fit"]["cropped_tokens"] == 0 and m["best_fit"]["split_documents"] >= 1
    assert "rows best-fit:" in r.stderr and "split into rows of their own" in r.stderr
    assert rows.size + m["best_fit"]["leftover_tokens"] == sum(len(d) + 2 for d in docs)
    assert m["document_tokens"] == sum(len(d) + 1 for d in docs)  # the documents' tokens and EOS, not the rows'


@pytest.mark.ray
def test_bos_aligned_rows_start_at_a_document_and_follow_the_best_fit_rule(ray_address, capsys, tmp_path, tok_path, tok):
    """--rows bos-aligned: every row starts with BOS; each BOS opens one corpus document, whole and followed by its
    EOS, except the last of a row, which may be cropped (never continued in the next row); the rows equal
    minilm.rows.bos_aligned_rows of the same documents."""
    from minilm.rows import bos_aligned_rows

    seq = 31
    src = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    err = prep(capsys, "--input", src, "--output", tmp_path / "out", "--seq-len", seq, "--tokenizer",
               tok_path, "--rows", "bos-aligned")
    rows, m = read_all(tmp_path / "out"), manifest_of(tmp_path / "out")
    docs = [tok.encode(d, add_special_tokens=False).ids for d in DOCS]
    expected, fit = bos_aligned_rows(docs, seq + 1)
    assert np.array_equal(rows, expected)
    assert m["rows"] == "bos-aligned" and m["best_fit"]["rows"] == len(rows) == fit.rows
    assert "rows bos-aligned:" in err and "documents cropped" in err
    whole = {tuple(d) for d in docs}
    for row in rows.tolist():
        assert row[0] == 1
        starts = [i for i, t in enumerate(row) if t == 1] + [len(row)]
        for k, (a, b) in enumerate(zip(starts, starts[1:], strict=False)):
            segment = row[a + 1:b]
            if k < len(starts) - 2 or (segment and segment[-1] == 2):  # a whole document: ids, then EOS
                assert segment[-1] == 2 and tuple(segment[:-1]) in whole, (row, k)
            else:  # the row's last document, cropped: a prefix of some document
                assert any(tuple(d[:len(segment)]) == tuple(segment) for d in docs), (row, k)
