"""Defaults a user expects (#47): RUN/config.yaml, the effective config of each start, which `--config` reads back;
seq_len and vocab_size from the data's manifest when not given; a warning for a relative run folder in a Ray job.

The minilm.train starts run in this process without training (`minilm.train.start`); the Ray side reads the shared
baseline run's folder (tests/conftest.py) and the sweeps of tests/test_tune.py check each trial's file.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from helpers import sigterm_kept
from inprocess import TINY_MODEL

from minilm import train
from minilm.config import ModelConfig, TrainConfig
from minilm.options import PER_START, RunOptions, build_configs, dump_yaml, flag_fields, load_yaml
from minilm.run import CONFIG, check_run
from ray_jobs import pretrain
from ray_jobs.cli import RayOptions
from ray_jobs.ray_compat import JOB_DRIVER_ENV

SECRET = "s3cret-pw"
TINY = [f"--{k.replace('_', '-')}={v}" for k, v in TINY_MODEL.items() if k != "vocab_size"] + [
    "--max-steps=4", "--global-batch-size=16", "--micro-batch-size=4", "--warmup-steps=1", "--optimizer=adamw"]


def start(*argv) -> train.RunPlan:
    """`python -m minilm.train ARGV` up to its first step (the run folder claimed, config.yaml written), then let go."""
    with sigterm_kept():
        trainer, plan = train.start([str(a) for a in argv])
    trainer.close("finished")
    plan.release()
    return plan


def run_flags(opts: RunOptions) -> dict:
    return {f.name: getattr(opts, f.name) for f in flag_fields(type(opts)) if f.name not in PER_START}


def test_config_yaml_is_the_effective_config_and_reruns_the_same_run(run_data, tmp_path):
    run = tmp_path / "run"
    secret_uri = f"http://alice:{SECRET}@mlflow.example:5000/"
    first = start("--data", run_data, "--run-dir", run, *TINY, "--keep-checkpoints", "2", "--mlflow-uri", secret_uri,
                  "--exit-after-steps", "2", "--resume", "auto")
    text = (run / CONFIG).read_text()
    assert SECRET not in text and "mlflow_uri: http://***@mlflow.example:5000/" in text
    assert text.startswith("# run run, started ") and "# *** stands for a credential" in text
    values = yaml.safe_load(text)
    assert values["seq_len"] == 32 and values["vocab_size"] == 256  # the manifest's: the run's own values
    assert not set(values) & set(PER_START)  # this start's --exit-after-steps and --resume are not the run's
    # read back as --config: the same configs, the same run options (the secret given again as a flag wins)
    args = train.build_parser().parse_args(["--config", str(run / CONFIG), "--mlflow-uri", secret_uri])
    again = build_configs(args, load_yaml(args.config), train.LocalOptions)
    assert (again.model, again.train) == (first.model_cfg, first.train_cfg)  # --dtype auto as it was resolved
    assert run_flags(again.run) == run_flags(first.opts) and again.run.from_manifest == []
    # and as a command: the rerun continues the run folder, its configs those of the first start
    second = start("--config", run / CONFIG, "--mlflow-uri", secret_uri)
    assert (second.model_cfg, second.train_cfg, second.run_dir) == (first.model_cfg, first.train_cfg, run)  # both fp32
    assert yaml.safe_load((run / CONFIG).read_text()) == values and not [n for n in second.notes if "manifest" in n]


def test_each_start_rewrites_it_and_a_fresh_start_moves_the_old_one_aside(run_data, tmp_path):
    run = tmp_path / "run"
    assert train.main([str(a) for a in ("--data", run_data, "--run-dir", run, *TINY, "--max-steps", "2",
                                        "--dtype", "fp32")]) == 0
    start("--data", run_data, "--run-dir", run, *TINY, "--dtype", "fp32", "--lr", "2e-3", "--allow-config-change")
    assert yaml.safe_load((run / CONFIG).read_text())["lr"] == 2e-3  # the resumed run's values
    start("--data", run_data, "--run-dir", run, *TINY, "--dtype", "fp32", "--resume", "never", "--abandon-newer")
    assert yaml.safe_load(next(run.glob("abandoned-*/config.yaml")).read_text())["lr"] == 2e-3  # with its branch
    assert yaml.safe_load((run / CONFIG).read_text())["lr"] == 5e-4


def test_a_refused_command_writes_no_config(run_data, tmp_path, capsys):
    run = tmp_path / "run"
    assert train.main([str(a) for a in ("--data", run_data, "--run-dir", run, *TINY, "--tracker", "bogus")]) == 2
    assert "bogus" in capsys.readouterr().err and not run.exists()


def check(*argv, yaml_values: dict | None = None):
    """minilm.train's checks of ARGV (and a --config of `yaml_values`): the plan, nothing written."""
    args = train.build_parser().parse_args([str(a) for a in argv])
    return check_run(build_configs(args, yaml_values or {}, train.LocalOptions), train.LocalLaunch(1))


@pytest.mark.parametrize(("given", "yaml_values", "seq_len", "vocab_size", "note"), [
    ([], {}, 32, 256, "note: seq_len 32 and vocab_size 256 from the data's manifest"),
    (["--vocab-size", "300"], {}, 32, 300, "note: seq_len 32 from the data's manifest"),
    ([], {"seq_len": 32}, 32, 256, "note: vocab_size 256 from the data's manifest"),
    (["--seq-len", "32", "--vocab-size", "256"], {}, 32, 256, None),
])
def test_seq_len_and_vocab_size_not_given_are_the_manifests(run_data, given, yaml_values, seq_len, vocab_size, note):
    plan = check("--data", run_data, *TINY, *given, yaml_values=yaml_values)
    assert (plan.train_cfg.seq_len, plan.model_cfg.vocab_size) == (seq_len, vocab_size)
    assert [n for n in plan.notes if "manifest" in n] == ([note] if note else [])


def test_pretrain_takes_them_from_the_manifest_too(run_data):
    model, train_cfg, opts = build_configs(pretrain.build_parser().parse_args(["--data", str(run_data)]), {}, RayOptions)
    notes = []
    pretrain.RayLaunch(demo=False).open_data(model, train_cfg, opts, notes)  # no Ray: --data is a local folder
    assert (train_cfg.seq_len, model.vocab_size) == (32, 256)
    assert "note: seq_len 32 and vocab_size 256 from the data's manifest" in notes


@pytest.mark.parametrize(("given", "yaml_values", "message"), [
    (["--seq-len", "64"], {}, "packed with seq_len 32 but the run asks for seq_len 64 (set --seq-len 32"),
    ([], {"seq_len": 64}, "packed with seq_len 32 but the run asks for seq_len 64"),
    (["--vocab-size", "128"], {}, "its tokenizer has 256 tokens but the model's vocab_size is 128"),
])
def test_a_seq_len_or_vocab_size_given_that_does_not_fit_the_data_is_refused(run_data, given, yaml_values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        check("--data", run_data, *TINY, *given, yaml_values=yaml_values)


def test_a_manifests_seq_len_is_checked_against_the_model_too(run_data):
    with pytest.raises(ValueError, match=r"seq_len \+ 1 \(33\) exceeds max_position_embeddings \(16\)"):
        check("--data", run_data, *TINY, "--max-position-embeddings", "16")


def test_dump_yaml_hides_every_credential_and_leaves_out_what_belongs_to_one_start():
    opts = RayOptions(data="s3://key:secret1@bucket/tok?token=secret2", storage_path="s3://b/runs?secret_key=secret3",
                      name="r1", resume="never", abandon_newer=True, exit_after_minutes=5.0)
    text = dump_yaml(ModelConfig(), TrainConfig(), opts)
    assert "secret" not in text.replace("secret_key", "") and "*** stands for a credential" in text
    values = yaml.safe_load(text)
    assert values["data"] == "s3://***@bucket/tok?token=***" and values["name"] == "r1"
    assert not set(values) & set(PER_START) and "cpus_per_worker" not in values  # unset (auto): left to the rerun


@pytest.mark.parametrize(("run_dir", "in_job", "warned"), [
    ("runs/r1", True, True), (None, True, True), ("/shared/runs/r1", True, False), ("s3://b/runs/r1", True, False),
    ("runs/r1", False, False)])
def test_a_relative_run_folder_in_a_ray_job_is_warned(tmp_path, monkeypatch, capsys, run_dir, in_job, warned):
    monkeypatch.chdir(tmp_path)
    if in_job:  # what Ray's job supervisor hands the entrypoint of `ray job submit`
        monkeypatch.setenv(JOB_DRIVER_ENV, '{"metadata": {"job_submission_id": "raysubmit_1"}}')
    else:
        monkeypatch.delenv(JOB_DRIVER_ENV, raising=False)
    args = pretrain.build_parser().parse_args(["--run-dir", run_dir] if run_dir else [])
    configs = build_configs(args, {}, RayOptions)
    pretrain.RayLaunch(demo=False).check(*configs)
    err = capsys.readouterr().err
    if not warned:
        assert err == ""
        return
    assert err.count("\n") == 1 and err.startswith("warning: the run folder ") and f"({tmp_path})" in err, err
    assert "give --run-dir an absolute path on shared storage or a URI (s3://, gs://)" in err
    assert configs.run.storage_path == str(tmp_path / "runs")  # still resolved as before: only a warning


@pytest.mark.ray
@pytest.mark.slow  # reads the baseline run (~27 s, shared with tests/test_pretrain.py)
def test_a_ray_runs_folder_keeps_its_config_which_reruns_it(baseline, run_data, run_storage):
    from runs import tiny_args

    args = pretrain.build_parser().parse_args(tiny_args(run_data, run_storage, "baseline", "--num-workers", "2"))
    given = build_configs(args, {}, RayOptions)
    path = run_storage / "baseline" / CONFIG
    args = pretrain.build_parser().parse_args(["--config", str(path)])
    again = build_configs(args, load_yaml(args.config), RayOptions)
    assert (again.model, again.train) == (given.model, given.train)
    assert run_flags(again.run) == run_flags(dataclasses.replace(given.run, storage_path=str(run_storage.resolve())))


def test_a_sweep_points_seq_len_is_checked_against_the_model_when_the_manifest_set_the_runs():
    from minilm.config import ConfigError, ModelConfig, TrainConfig
    from ray_jobs.pretrain import RayOptions, check_options

    opts = RayOptions(from_manifest=["seq_len", "vocab_size"])
    with pytest.raises(ConfigError, match="exceeds max_position_embeddings"):
        check_options(ModelConfig(max_position_embeddings=64), TrainConfig(seq_len=256), opts)
    check_options(ModelConfig(max_position_embeddings=257), TrainConfig(seq_len=256), opts)


def test_optimizer_auto_is_said_on_the_start_line_recorded_and_a_resume_keeps_it_untimed(run_data, tmp_path,
                                                                                         monkeypatch, capsys):
    """--optimizer auto (the default) is resolved once at the start: the start line says which and why, config.yaml
    and state.json hold the choice; a resume keeps the checkpoint's without timing, and refuses another given one."""
    from minilm import step

    monkeypatch.setattr(step, "time_muon", lambda *a: (0.04, 1.0))
    run, auto = tmp_path / "run", [a for a in TINY if a != "--optimizer=adamw"]
    assert train.main(["--data", str(run_data), "--run-dir", str(run), *auto, "--exit-after-steps", "2"]) == 0
    assert "optimizer muon (auto: Newton-Schulz 0.04 s = 4% of a step, muon up to 50%)" in capsys.readouterr().out
    assert yaml.safe_load((run / CONFIG).read_text())["optimizer"] == "muon"
    assert yaml.safe_load(next(run.glob("checkpoint_*/state.json")).read_text())["train_config"]["optimizer"] == "muon"
    monkeypatch.setattr(step, "time_muon", lambda *a: pytest.fail("a resume timed Newton-Schulz"))
    assert start("--data", run_data, "--run-dir", run, *auto).train_cfg.optimizer == "muon"
    assert train.main(["--data", str(run_data), "--run-dir", str(run), *auto, "--optimizer", "adamw"]) == 2
    assert "optimizer adamw != muon in the checkpoint" in capsys.readouterr().err
