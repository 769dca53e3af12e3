"""Property-based fuzzing of every input a user hands minilm (issue #33): JSONL records, YAML configs, manifests
and flags. Whatever the input: no traceback; a refusal is an `error:` line and exit 2 (a DataError or a
UsageError of one line where the code raises one). No Ray: prepare is fed records that never reach its
tokenizer tasks, and minilm.train's Trainer is a stand-in once every check has passed.

The counts of cases tried are printed at the end of the module (pytest -s shows them).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import _tokenizer, make_prepared
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minilm import data as D
from minilm import train
from minilm.cli import UsageError
from ray_jobs import prepare
from ray_jobs.prepare_inputs import RecordReader, Source

CASES: Counter[str] = Counter()
FUZZ = settings(max_examples=120, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    yield
    print(f"\nfuzz cases tried: {dict(CASES)} (total {sum(CASES.values())})")


def one_line_error(err: str) -> None:
    """stderr of a refused command: `error: ...` first, never a traceback."""
    assert "Traceback" not in err and err.startswith("error: "), err[-2000:]


# ---- JSONL records ------------------------------------------------------------------------------------------

def nested(depth: int) -> bytes:
    return b'{"text": "a", "x": ' + b"[" * depth + b"]" * depth + b"}"


hostile_record = st.one_of(
    st.integers(1, 3000).map(nested),  # Python's json stops near 1,000 levels
    st.integers(1, 6000).map(lambda n: b'{"text": "a", "n": ' + b"7" * n + b"}"),  # int() stops at 4,300 digits
    st.sampled_from([b'{"text": "\\ud800"}', b'{"text": "\\udfff x"}', b'{"text": "a\x00"}', b"\x00",
                     b'{"text": 1e400}', b'{"text": null}', b"[]", b'"text"', b"\xff\xfe", b'{"text": ""}']),
    st.text(max_size=50).map(lambda k: json.dumps({k + "_": "v" * 5000}).encode()),  # no "text" field
    st.binary(max_size=60).map(lambda b: b.replace(b"\n", b"").replace(b"\r", b"")),
)
good_record = st.text(min_size=1, max_size=20000).map(lambda t: json.dumps({"text": t}).encode())


def usable(line: bytes) -> bool:
    """Whether prepare would tokenize this line (a test that must not start Ray leaves such lines out)."""
    try:
        text = json.loads(line.decode("utf-8")).get("text")
        return isinstance(text, str) and bool(text.encode("utf-8"))
    except (ValueError, RecursionError, AttributeError, UnicodeEncodeError):
        return False


@FUZZ
@given(lines=st.lists(st.one_of(hostile_record, good_record), min_size=1, max_size=6))
def test_jsonl_records_are_kept_or_skipped_or_one_line(tmp_path_factory, lines):
    CASES["jsonl records"] += 1
    src = tmp_path_factory.mktemp("jsonl") / "in.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    source = [Source(src, "in.jsonl", "jsonl", src.stat().st_size)]
    warned: list[str] = []
    reader = RecordReader(source, "text", "skip", warn=lambda where, detail: warned.append(f"{where}: {detail}"))
    kept = list(reader)
    assert all(isinstance(text, str) and text.encode() for text, _ in kept)
    lines[0] = lines[0].removeprefix(b"\xef\xbb\xbf")  # a byte order mark opening the file is dropped
    assert len(kept) + reader.documents_skipped == sum(bool(line.strip()) for line in lines)
    assert all("\n" not in w and len(w) < 400 for w in warned), [w[:400] for w in warned]
    try:
        assert len(list(RecordReader(source, "text", "error"))) == len(kept)
    except UsageError as e:
        assert str(e).startswith("in.jsonl:") and "\n" not in str(e) and len(str(e)) < 400, str(e)[:400]


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    _tokenizer(300, path)
    return path


@FUZZ
@given(lines=st.lists(hostile_record.filter(lambda line: not usable(line)), min_size=1, max_size=4),
       mode=st.sampled_from(["skip", "error"]))
@pytest.mark.slow
def test_prepare_on_hostile_records_exits_2_with_one_error_line(tmp_path_factory, tokenizer_file, capsys, lines,
                                                                 mode):
    """Records that are all bad or empty never reach Ray's tokenizer tasks: the whole command runs here."""
    CASES["prepare runs"] += 1
    tmp = tmp_path_factory.mktemp("prep")
    (tmp / "in.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    code = prepare.main(["--input", str(tmp / "in.jsonl"), "--output", str(tmp / "out"), "--tokenizer",
                         str(tokenizer_file), "--seq-len", "8", "--on-bad-record", mode])
    err = capsys.readouterr().err
    assert code == 2 and not (tmp / "out").exists()
    lines_out = [line for line in err.splitlines() if not line.startswith(("warning: ", "hint: "))]
    assert len(lines_out) == 1 and lines_out[0].startswith("error: "), err[-2000:]


# ---- minilm.train: YAML configs and flags -------------------------------------------------------------------

class StandInTrainer:
    """What run_cli needs of a Trainer: reached only by a run every check let through."""

    def __init__(self, *args, **kwargs):
        self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
        self.history, self.step, self.total_steps = [], 0, 0

    def fit(self):
        CASES["runs every check let through"] += 1
        return "finished"

    def close(self, outcome):
        pass


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a config's relative names (run_dir: 5) land here
    monkeypatch.setattr(train, "Trainer", StandInTrainer)
    return tmp_path


def run_train(argv: list[str], capsys) -> int:
    capsys.readouterr()
    try:
        code = train.main(argv)
    except SystemExit as e:  # argparse: a flag of the wrong type is its usage line and exit 2
        assert e.code == 2 and "error: argument" in capsys.readouterr().err
        return 2
    err = capsys.readouterr().err
    assert code in (0, 2), err
    if code == 2:
        one_line_error(err)
    return code


# Every option of minilm.train (its flags' names), but the paths: a config's values land in the test's folder.
FIELDS = sorted({a.dest for a in train.build_parser()._actions} - {"help", "config", "data", "tokens", "run_dir"})
# How people write values in YAML, unquoted: floats, ints, YAML 1.1's specials, and what is not a number.
SPELLINGS = ["5e-4", "1e6", "1.0e6", "1E6", "0.0005", ".5", "1.", "+12", "-3", "0", "-0", "1_000", "0x1F", "0o17",
             "1:30", ".inf", "-.Inf", ".nan", "~", "null", "yes", "no", "on", "true", "1e400", "9" * 400,
             "-" + "9" * 30, "[1, 2]", "{a: 1}", "'text'", "2024-01-01", "2024-13-45", "a b", "'../x'", "[[[[]]]]"]
yaml_value = st.one_of(st.sampled_from(SPELLINGS), st.integers(-10**6, 10**6).map(str),
                       st.floats(allow_nan=False).map(repr), st.text(alphabet="abc019._-", max_size=8))
yaml_key = st.one_of(st.sampled_from(FIELDS), st.sampled_from(["1", "~", "[a]", "not_a_field", "lr-", "Lr"]))


@pytest.mark.slow
@FUZZ
@given(items=st.dictionaries(yaml_key, yaml_value, max_size=5))
def test_yaml_configs_run_or_exit_2_with_an_error_line(in_tmp, capsys, items):
    CASES["yaml configs"] += 1
    (in_tmp / "c.yaml").write_text("".join(f"{k}: {v}\n" for k, v in items.items()))
    assert run_train(["--config", "c.yaml", "--random-tokens", "20000", "--max-steps", "1"], capsys) in (0, 2)


NUMERIC_FLAGS = ["--seed", "--seq-len", "--micro-batch-size", "--global-batch-size", "--lr", "--warmup-steps",
                 "--max-steps", "--epochs", "--hidden-size", "--num-hidden-layers", "--num-attention-heads",
                 "--vocab-size", "--max-position-embeddings", "--rope-theta", "--dropout", "--grad-clip",
                 "--weight-decay", "--min-lr-ratio", "--log-every", "--checkpoint-every", "--keep-checkpoints",
                 "--val-samples", "--eval-every", "--exit-after-steps", "--exit-after-minutes",
                 "--checkpoint-every-minutes", "--collective-timeout-s", "--random-tokens"]
flag_value = st.one_of(st.sampled_from(["-1", "0", "-0", "1e308", "-1e308", "nan", "inf", "-inf", str(2**63),
                                        str(-2**63), str(10**30), "1e-300"]),
                       st.integers(-2**70, 2**70).map(str))


@pytest.mark.slow
@FUZZ
@given(flags=st.dictionaries(st.sampled_from(NUMERIC_FLAGS), flag_value, min_size=1, max_size=3))
def test_flags_negative_zero_or_huge_run_or_exit_2_with_an_error_line(in_tmp, capsys, flags):
    CASES["flag sets"] += 1
    argv = [a for kv in flags.items() for a in kv]
    if "--random-tokens" not in flags:
        argv += ["--random-tokens", "20000"]
    code = run_train(argv, capsys)
    assert code == 2 or all(float(v) >= 0 or v == "nan" for v in flags.values()), "a negative value was taken"


# ---- manifests ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_dataset(tmp_path_factory) -> Path:
    path = make_prepared(tmp_path_factory.mktemp("good") / "d", num_sequences=12, seq_len=7, vocab_size=300,
                         rows_per_shard=5)
    for f in path.iterdir():  # old enough to be stamped
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns - 10**10))
    return path


BAD_VALUES = [None, True, "", "x", "../x", "a/b", "12", -1, 0, 1, 10**30, 2**64, 1e400, -1e400, 0.5, [], [1], {},
              {"a": 1}, "uint8", "minilm-packed-v1", "0" * 64, "shard-00000.bin", "tokenizer.json", 65535, 65536]


@settings(FUZZ, max_examples=300)
@given(data=st.data())
def test_manifests_open_or_are_one_data_error(good_dataset, tmp_path_factory, data):
    CASES["manifests"] += 1
    path = tmp_path_factory.mktemp("m") / "d"
    shutil.copytree(good_dataset, path, copy_function=shutil.copy2)
    manifest = json.loads((path / "manifest.json").read_text())
    for _ in range(data.draw(st.integers(1, 3))):
        level = data.draw(st.sampled_from(["top", "tokenizer", "shard"]))  # each as likely: the top has most keys
        if not isinstance(manifest.get("tokenizer"), dict) or not isinstance(manifest.get("shards"), list) or \
                not manifest["shards"] or not all(isinstance(s, dict) and s for s in manifest["shards"]):
            level = "top"  # a field above was replaced already
        container = {"top": manifest, "tokenizer": manifest.get("tokenizer")}.get(level) or \
            data.draw(st.sampled_from(manifest["shards"]))
        if not container:
            break
        key = data.draw(st.sampled_from(sorted(container)))
        if data.draw(st.booleans()):
            container.pop(key)
        else:
            # a copy: a later pop from {"a": 1} put here would change BAD_VALUES itself, and so the next examples
            container[key] = copy.deepcopy(data.draw(st.sampled_from(BAD_VALUES)))
    text = json.dumps(manifest)
    raw = data.draw(st.sampled_from([None, "9" * 5000, "[" * 3000 + "]" * 3000]))
    if raw is not None and '"seq_len": ' in text:  # what json.dumps cannot write: a 5,000-digit int, deep nesting
        text = text.replace('"seq_len": ', f'"seq_len": {raw}, "x": ', 1)
    (path / "manifest.json").write_text(text)
    for where in (path, f"file://{path}"):
        try:
            opened = D.open_prepared(where)
            D.check_compatible(opened, vocab_size=300, seq_len=7)
            if opened.path is not None and opened.num_sequences > 0:
                rows = D.SequenceStore(opened).take(np.arange(opened.num_sequences))
                assert rows.max() < opened.vocab_size
        except D.DataError as e:
            assert "\n" not in str(e) and len(str(e)) < 1000, str(e)[:1000]
