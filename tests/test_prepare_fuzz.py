"""Fuzzing `ray_jobs.prepare` with arbitrary bytes and arbitrary JSON lines.

Whatever the input: skip mode exits 0 with every valid record kept (or 2 when nothing usable is
left), error mode exits 0 or names the first bad line as file:line, and no exception escapes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minilm.tokenizer import save_tokenizer, train_tokenizer
from ray_jobs import prepare

pytestmark = [pytest.mark.ray, pytest.mark.timeout(600)]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6)
record_line = st.one_of(
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ").replace(b"\r", b" ")),  # arbitrary bytes
    json_values.map(lambda v: json.dumps(v).encode()),  # arbitrary JSON
    st.text(max_size=60).map(lambda t: json.dumps({"text": t}).encode()),  # valid-looking records
    st.text(min_size=20, max_size=80).map(lambda t: json.dumps({"text": t, "id": 1}, ensure_ascii=False).encode()),
)


def classify(line: bytes) -> str | None:
    """The oracle: None for a valid record, 'blank' for a skipped blank line, else a reason."""
    if not line.strip():
        return "blank"
    try:
        obj = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "bad"
    if not isinstance(obj, dict) or "text" not in obj or not isinstance(obj["text"], str):
        return "bad"
    if obj["text"] == "":
        return "empty"  # counted and skipped in both modes
    try:
        obj["text"].encode("utf-8")
    except UnicodeEncodeError:
        return "bad"  # a lone surrogate from a \\ud800 escape
    return None


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_tokenizer(["fuzzing the prepare command with text"] * 20, vocab_size=300), path)
    return path


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(record_line, min_size=1, max_size=8))
@example(lines=[b"\xef\xbb\xbf"])  # found by this test: a file holding only a byte order mark is an empty input
def test_prepare_never_crashes_and_keeps_every_valid_record(ray_address, tokenizer_path, tmp_path_factory, lines,
                                                            capsys):
    tmp = tmp_path_factory.mktemp("fuzz")
    src = tmp / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    # a UTF-8 byte order mark opening the file is not part of its first record (the reader drops it)
    kinds = [classify(line[3:] if i == 0 and line.startswith(b"\xef\xbb\xbf") else line)
             for i, line in enumerate(lines)]
    valid = sum(k is None for k in kinds)

    code = prepare.main(["--input", str(src), "--output", str(tmp / "skip"), "--tokenizer", str(tokenizer_path),
                         "--seq-len", "4", "--on-bad-record", "skip"])
    err = capsys.readouterr().err
    assert code in (0, 2), err
    if code == 0:
        manifest = json.loads((tmp / "skip" / "manifest.json").read_text())
        assert manifest["documents_read"] == valid, (kinds, manifest)
        assert manifest["documents_skipped"] == sum(k not in (None, "blank") for k in kinds)
    else:
        assert "error:" in err and "Traceback" not in err
        assert valid == 0 or "too little" in err or "sequence" in err, err
        assert not (tmp / "skip").exists()

    code = prepare.main(["--input", str(src), "--output", str(tmp / "strict"), "--tokenizer", str(tokenizer_path),
                         "--seq-len", "4"])
    err = capsys.readouterr().err
    first_bad = next((i for i, k in enumerate(kinds, 1) if k == "bad"), None)
    if first_bad is not None:
        assert code == 2 and f"in.jsonl:{first_bad}:" in err, (kinds, err)
        assert "Traceback" not in err and not (tmp / "strict").exists()
    else:
        assert code in (0, 2), err
