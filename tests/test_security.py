"""Issue #33: no secret in any output or saved file, no name that leaves its folder, one line for hostile input.

docs/security.md lists what each test here shows. No Ray is started.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers import ROOT, make_prepared

from minilm import data as D
from minilm.cli import UsageError, fail, load_yaml
from minilm.config import ModelConfig, TrainConfig
from minilm.rows import rows_note
from minilm.safety import check_name, join_uri, redact

SECRET = "hunter2"


# ---- one redaction ---------------------------------------------------------------------------------

@pytest.mark.parametrize("text, shown", [
    ("postgresql://u:hunter2@db/mlflow", "postgresql://***@db/mlflow"),
    ("http://user:hunter2@mlflow:5000", "http://***@mlflow:5000"),
    ("error: cannot open s3://AKIA:hunter2@bucket/x: refused; retry s3://b/y?secret_key=hunter2&region=eu",
     "error: cannot open s3://***@bucket/x: refused; retry s3://b/y?secret_key=***&region=eu"),
    ("s3://b/x?X-Amz-Credential=hunter2&X-Amz-Signature=hunter2&sig=hunter2&password=hunter2",
     "s3://b/x?X-Amz-Credential=***&X-Amz-Signature=***&sig=***&password=***"),
    ("s3://AKIA:hun/ter2@bucket/x", "s3://***@bucket/x"),  # a password with a slash
    ("s3://AKIA:hun?ter#2'@bucket/x?region=eu", "s3://***@bucket/x?region=eu"),  # ? # ' in a password, as
    ("open s3://AKIA:it's@bucket/x?secret_key=k now", "open s3://***@bucket/x?secret_key=*** now"),  # pyarrow takes them
    ("s3://b/y?endpoint_override=http://u:pw@host&region=x", "s3://b/y?endpoint_override=http://***@host&region=x"),
    ("DataError('gs://b/x?token=hunter2')", "DataError('gs://b/x?token=***')"),
    ("plain text, /a/path and s3://bucket/key?region=eu-west-1", "plain text, /a/path and s3://bucket/key?region=eu-west-1"),
    # storage URIs as the driver's start line prints them (test_options.py)
    ("s3://bucket/runs?region=eu-west-1&access_key=AKIAX&secret_key=s%2Fecret",
     "s3://bucket/runs?region=eu-west-1&access_key=***&secret_key=***"),
    ("s3://bucket/runs?session_token=abc&endpoint_override=http%3A%2F%2Fuser%3Apass%40minio%3A9000",
     "s3://bucket/runs?session_token=***&endpoint_override=http://***@minio:9000"),
    ("s3://AKIAX:secret@bucket/runs", "s3://***@bucket/runs"),
    ("gs://bucket/runs", "gs://bucket/runs"),
    ("/local/runs", "/local/runs"),
])
def test_redact_removes_credentials_from_any_text(text, shown):
    assert redact(text) == shown and redact(None) is None


def test_every_error_line_is_redacted(capsys):
    assert fail(f"cannot reach http://user:{SECRET}@host/x") == 2
    assert capsys.readouterr().err == "error: cannot reach http://***@host/x\n"


def test_data_errors_the_rows_note_and_check_compatible_carry_no_credentials(tmp_path):
    with pytest.raises(D.DataError) as e:  # pyarrow's own message repeats the URI
        D.open_prepared(f"file://user:{SECRET}@/nonexistent/data")
    assert SECRET not in str(e.value) and "file://***@/nonexistent/data" in str(e.value)
    local = D.open_prepared(make_prepared(tmp_path / "d", num_sequences=8, seq_len=16, vocab_size=256))
    remote = D.PreparedData(None, local.manifest, uri=f"s3://bucket/d?secret_key={SECRET}")
    with pytest.raises(D.DataError) as e:
        D.check_compatible(remote, vocab_size=128, seq_len=16)
    assert SECRET not in str(e.value) and "s3://bucket/d?secret_key=***" in str(e.value)
    assert SECRET not in rows_note({"rows": "packed"}, f"s3://AKIA:{SECRET}@bucket/d")


def mlflow_store(monkeypatch, tmp_path):
    """MLflow's client pointed at a SQLite file whatever URI minilm gives it: a password URI without a server."""
    pytest.importorskip("mlflow")
    import mlflow.tracking

    real = mlflow.tracking.MlflowClient
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setattr(mlflow.tracking, "MlflowClient", lambda tracking_uri: real(tracking_uri=db))


def test_an_mlflow_password_is_in_no_checkpoint_state_sidecar_or_resume_line(monkeypatch, tmp_path):
    from minilm import trackers as T

    mlflow_store(monkeypatch, tmp_path)
    opts = {"mlflow_uri": f"http://user:{SECRET}@mlflow.internal:5000"}
    run = tmp_path / "run"
    run.mkdir()
    first = T.open_trackers(["mlflow"], run_dir=run, run_name="r", hparams={"a": 1}, options=opts)
    first.log({"loss": 1.0}, 1)
    state = first.state_dict()
    first.close()
    assert state["mlflow"]["tracking_uri"] == "http://***@mlflow.internal:5000"
    assert state["mlflow"]["tracking_uri_redacted"] is True
    assert SECRET not in json.dumps(state) and SECRET not in (run / "trackers.json").read_text()
    said: list[str] = []
    again = T.open_trackers(["mlflow"], run_dir=run, run_name="r", resume_state=state, options=opts,
                            say=said.append)  # the resume gets the password from its flag again
    assert again.state_dict()["mlflow"]["run_id"] == state["mlflow"]["run_id"] and not again.backends[0].new_run
    assert SECRET not in again.backends[0].describe() and said and not any(SECRET in line for line in said)
    again.close()


def test_a_tracker_error_names_the_store_without_its_password(monkeypatch, tmp_path):
    pytest.importorskip("mlflow")
    from minilm import trackers as T

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(T.TrackerError) as e:  # nothing listens on port 9: MLflow's message repeats the URI
        T.open_trackers(["mlflow"], run_dir=tmp_path, run_name="r",
                        options={"mlflow_uri": f"http://user:{SECRET}@127.0.0.1:9/"})
    assert SECRET not in str(e.value) and "http://***@127.0.0.1:9/" in str(e.value)


# ---- one rule for names that become paths ------------------------------------------------------------

@pytest.mark.parametrize("name", ["run1", "sweep-2024.05_a", "a" * 128, "0123456789abcdef" * 4, "A.b-c_d"])
def test_safe_names_pass(name):
    assert check_name(name, "--name") == name


@pytest.mark.parametrize("name", ["", ".", "..", "../x", ".hidden", "a/b", "a\\b", "a\x00b", "a b", "a\nb",
                                  "a" * 129, 123, None, "s3://u:hunter2@b"])
def test_unsafe_names_are_one_line_naming_what(name):
    with pytest.raises(UsageError) as e:
        check_name(name, "--name")
    message = str(e.value)
    assert message.startswith("--name ") and "is not a safe name" in message
    assert "\n" not in message and SECRET not in message and len(message) < 250


def test_a_manifest_fingerprint_cannot_move_the_node_local_copy_out_of_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MINILM_CACHE", str(tmp_path / "home" / ".cache" / "minilm"))
    src = make_prepared(tmp_path / "src", num_sequences=8, seq_len=16, vocab_size=256)
    manifest = json.loads((src / "manifest.json").read_text())
    manifest["fingerprint"] = "../../../.ssh"
    (src / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(D.DataError, match=r"fingerprint '\.\./\.\./\.\./\.ssh' is not a safe name"):
        D.open_local(f"file://{src}")
    assert not (tmp_path / "home" / ".ssh").exists()


def test_minilm_train_reads_remote_data_through_a_node_local_copy(tmp_path, capsys, monkeypatch):
    from minilm import train

    monkeypatch.setenv("MINILM_CACHE", str(tmp_path / "cache"))
    src = make_prepared(tmp_path / "src", num_sequences=8, seq_len=16, vocab_size=256)
    tiny = ["--vocab-size", "256", "--seq-len", "16", "--hidden-size", "32", "--num-hidden-layers", "1",
            "--num-attention-heads", "2", "--num-key-value-heads", "1", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--max-steps", "1", "--dtype", "fp32", "--log-every", "1"]
    assert train.main(["--data", f"file://{src}", *tiny]) == 0, capsys.readouterr().err
    copy = tmp_path / "cache" / "data" / json.loads((src / "manifest.json").read_text())["fingerprint"][:32]
    assert D.open_prepared(copy).num_sequences == 8  # the node's copy, which the run read


def test_tune_joins_the_sweep_name_before_a_query(monkeypatch):
    """s3://bucket/x?endpoint_override=... + sweep1: the name goes into the path, not after the `?`."""
    import ray.tune

    from ray_jobs import tune

    @dataclasses.dataclass
    class Plan:  # what sweep() reads of a RunPlan before it asks Tune
        opts: object
        lease: object = None

    seen = []
    monkeypatch.setattr(ray.tune, "with_parameters", lambda f, **kw: f)
    monkeypatch.setattr(ray.tune, "with_resources", lambda f, res: f)
    monkeypatch.setattr(ray.tune.Tuner, "can_restore", staticmethod(lambda path: seen.append(path) or True))
    plan = Plan(SimpleNamespace(storage_path="s3://bucket/x?endpoint_override=http://minio:9000", name="sweep1"))
    with pytest.raises(UsageError, match="already exists"):
        tune.sweep(plan, {}, 1, 1, "none", 1, "loss", resume=False)
    assert seen == ["s3://bucket/x/sweep1?endpoint_override=http://minio:9000"]
    assert join_uri("/local/runs/", "a", "trials") == "/local/runs/a/trials"


# ---- hostile input: one line ------------------------------------------------------------------------

def retoken(path: Path, shard: int, ids: np.ndarray) -> None:
    """Hand-edit a token file and its manifest entry (the hash matches: only the range check can tell)."""
    manifest = json.loads((path / "manifest.json").read_text())
    entry = manifest["shards"][shard]
    (path / entry["file"]).write_bytes(ids.astype("<u2").tobytes())
    entry["sha256"] = hashlib.sha256(ids.astype("<u2").tobytes()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(manifest))
    for f in path.iterdir():  # written long ago: old enough for a verification stamp
        os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns - 10**10))


def test_token_ids_at_or_above_the_vocabulary_are_refused_once_per_shard_when_opened(tmp_path, monkeypatch):
    path = make_prepared(tmp_path / "d", num_sequences=8, seq_len=15, vocab_size=256, rows_per_shard=4)
    ids = np.full(4 * 16, 7)
    ids[37] = 256
    retoken(path, 1, ids)
    with pytest.raises(D.DataError) as e:
        D.open_prepared(path)
    assert str(e.value).startswith(f"{path / 'shard-00001.bin'}: token id 256 is not below the vocabulary size 256")
    retoken(path, 1, np.full(4 * 16, 255))
    from minilm.data import verified

    reads = []
    real = verified._top_id
    monkeypatch.setattr(verified, "_top_id", lambda p, dtype: reads.append(p.name) or real(p, dtype))
    for _ in range(3):
        D.open_prepared(path)  # the largest id is stamped with the hash: read once
    assert sorted(reads) == ["shard-00000.bin", "shard-00001.bin", "tokenizer.json"]


HOSTILE_LINES = {  # what each JSONL line is, for prepare
    b'{"text": "a", "n": ' + b"9" * 5000 + b"}": "bad",  # an integer past Python's 4,300-digit limit
    b'{"text": "a", "n": ' + b"[" * 5000 + b"]" * 5000 + b"}": "bad",  # nesting past the stack
    b'{"text": "\\ud800"}': "bad",  # a lone surrogate
    b'{"text": "a\x00b"}': "bad",  # a raw NUL: a control character JSON does not allow
    b'{"text": "a\\u0000b"}': "ok",  # an escaped NUL is text
    b'{"' + b"k" * (10 << 20) + b'": 1}': "bad",  # a 10 MB line without "text": its message stays short
    b'{"text": "' + b"x" * (10 << 20) + b'"}': "ok",  # a 10 MB document
}


@pytest.mark.parametrize("mode", ["skip", "error"])
def test_prepare_reads_hostile_jsonl_lines_as_bad_records(tmp_path, mode):
    from ray_jobs.prepare_inputs import RecordReader, Source

    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(HOSTILE_LINES) + b"\n")
    warned: list[str] = []
    reader = RecordReader([Source(src, "in.jsonl", "jsonl", src.stat().st_size)], "text", mode,
                          warn=lambda where, detail: warned.append(f"{where}: {detail}"))
    if mode == "error":
        with pytest.raises(UsageError) as e:
            list(reader)
        assert str(e.value).startswith("in.jsonl:1: JSON that Python refuses to read (Exceeds the limit")
        return
    kept = [text for text, _ in reader]
    assert len(kept) == list(HOSTILE_LINES.values()).count("ok") and kept[0] == "a\x00b"
    assert reader.documents_skipped == list(HOSTILE_LINES.values()).count("bad") == len(warned)
    assert all("\n" not in w and len(w) < 300 for w in warned), [w[:300] for w in warned]


def test_a_negative_seed_is_refused_before_any_worker_starts(capsys):
    import ray

    from minilm import train
    from ray_jobs import pretrain

    assert "seed must be an integer >= 0" in " ".join(TrainConfig(seed=-1).problems())
    assert train.main(["--random-tokens", "5000", "--seed", "-1", "--max-steps", "1"]) == 2
    assert "seed must be an integer >= 0" in capsys.readouterr().err
    assert pretrain.main(["--seed", "-1"]) == 2 and not ray.is_initialized()  # the driver's check, before Ray
    assert "seed must be an integer >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../escape", "/etc", "a/b", ".hidden"])
def test_a_run_name_that_would_leave_its_storage_is_refused_before_anything_is_written(tmp_path, capsys, name):
    import ray

    from minilm import train
    from ray_jobs import pretrain, tune

    storage = tmp_path / "runs"
    assert pretrain.main(["--name", name, "--storage-path", str(storage)]) == 2 and not ray.is_initialized()
    assert tune.main(["--name", name, "--storage-path", str(storage), "--search", "lr=choice:1e-3"]) == 2
    assert train.main(["--random-tokens", "5000", "--name", name, "--run-dir", str(storage / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count(f"error: --name {name!r} is not a safe name") == 3, err
    assert not tmp_path.joinpath("runs").exists() and not Path(tmp_path.parent / "escape").exists()


def test_yaml_numbers_as_people_write_them(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("lr: 5e-4\nrope_theta: 1e6\nwarmup-steps: '10'\nname: 123\nmax_steps: 100\ngrad_clip: 1\n")
    values = load_yaml(str(cfg))
    assert values == {"lr": 5e-4, "rope_theta": 1e6, "warmup_steps": 10, "name": "123", "max_steps": 100,
                      "grad_clip": 1}
    ModelConfig(rope_theta=values["rope_theta"]).validate()
    TrainConfig(**{k: v for k, v in values.items() if k != "rope_theta" and k != "name"}).validate()


@pytest.mark.parametrize("text, message", [
    ("storage_path: [1, 2]\n", "storage_path must be a string, got [1, 2]"),
    ("name: true\n", "name must be a string, got True"),
    ("1: 2\n", "option names must be strings, got 1"),
    ("when: 2024-13-45\n", "not valid YAML"),  # PyYAML's date raises ValueError
    ("lr: " + "[" * 3000 + "]" * 3000 + "\n", "not valid YAML"),
])
def test_yaml_values_a_flag_cannot_give_are_one_line(tmp_path, text, message):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(UsageError) as e:
        load_yaml(str(cfg))
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- dependencies --------------------------------------------------------------------------------------

def test_torch_floor_is_the_release_that_fixed_the_weights_only_bypass():
    """CVE-2025-32434: torch.load(weights_only=True) could run code before 2.6; resume safety rests on it."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floor = next(d for d in deps if d.startswith("torch>="))
    assert tuple(int(x) for x in floor.removeprefix("torch>=").split(".")) >= (2, 6), floor
    assert tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 6)


def test_the_config_ray_shows_carries_no_secret_and_the_workers_get_them_back(monkeypatch):
    """train_loop_config is shown in the Ray dashboard: the data URI's, storage's and tracker URI's credentials are
    redacted there and travel in the object store (a ref under "secrets"), which the worker reads back."""
    import json

    import ray

    from ray_jobs import worker
    from ray_jobs.pretrain import without_secrets

    run = {"data": f"s3://b/d?secret_key={SECRET}", "data_dir": f"s3://AK:{SECRET}@b/d", "name": "r",
           "mlflow_uri": f"http://u:{SECRET}@mlflow:5000", "storage_path": "/runs", "keep_checkpoints": 3}
    config = {"model": {}, "train": {}, "run": run, "steps": {}}
    shown, hidden = without_secrets(config)
    assert SECRET not in json.dumps(shown) and shown["run"]["storage_path"] == "/runs"
    assert sorted(hidden) == ["data", "data_dir", "mlflow_uri"] and shown["run"]["name"] == "r"
    monkeypatch.setattr(ray, "get", lambda ref: ref)  # the object store's round trip, here the dict itself
    assert worker.with_secrets({**shown, "secrets": hidden})["run"] == run
    assert worker.with_secrets(shown) is shown
