"""minilm.options: one RunOptions dataclass makes the run flags of both CLIs, reads YAML, checks values; plan_steps
works out a run's steps and batch checks; the dtype table; storage URIs printed without their secrets."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import pytest
import torch

from minilm import data as D
from minilm.cli import UsageError
from minilm.config import DTYPES, ConfigError, TrainConfig
from minilm.options import RunOptions, build_configs, plan_steps
from minilm.step import DTYPE_NAMES, TORCH_DTYPES, resolve_dtype
from minilm.train import LocalOptions
from minilm.train import build_parser as train_parser
from ray_jobs.cli import ELASTIC_MAX_FAILURES, RayOptions
from ray_jobs.pretrain import build_parser as pretrain_parser

# The run flags users type today: a rename or a lost flag is a broken command line.
SHARED_FLAGS = {"--data", "--name", "--resume", "--abandon-newer", "--keep-checkpoints", "--exit-after-steps",
                "--exit-after-minutes", "--collective-timeout-s", "--tracker", "--mlflow-uri", "--wandb-project",
                "--allow-config-change", "--dry-run"}
TRAIN_FLAGS = SHARED_FLAGS | {"--tokens", "--random-tokens", "--run-dir"}
PRETRAIN_FLAGS = SHARED_FLAGS | {"--num-workers", "--use-gpu", "--cpus-per-worker", "--resources-per-worker",
                                 "--storage-path", "--max-failures", "--elastic-check-seconds", "--backend-timeout-s",
                                 "--num-cpus", "--eval-tasks", "--eval-resources", "--eval-best",
                                 "--eval-wait-minutes"}


def run_actions(parser: argparse.ArgumentParser, cls) -> dict[str, argparse.Action]:
    fields = {f.name for f in dataclasses.fields(cls)}
    return {a.dest: a for a in parser._actions if a.dest in fields}


def test_both_clis_have_the_same_flag_for_the_same_field_and_the_flags_users_type():
    train, pretrain = run_actions(train_parser(), LocalOptions), run_actions(pretrain_parser(), RayOptions)
    assert {s for a in train.values() for s in a.option_strings} == TRAIN_FLAGS
    assert {s for a in pretrain.values() for s in a.option_strings} == PRETRAIN_FLAGS
    shared = set(train) & set(pretrain)
    assert shared == {f.name for f in dataclasses.fields(RunOptions) if f.metadata.get("help")}
    # the Ray-only options live in ray_jobs/, minilm.train's own in minilm/train.py
    assert not {f.name for f in dataclasses.fields(RayOptions)} & {"tokens", "random_tokens"}
    assert not {f.name for f in dataclasses.fields(RunOptions)} & {"num_workers", "storage_path", "data_dir"}
    assert {"--val-samples", "--eval-every"} <= {s for a in train_parser()._actions for s in a.option_strings} & \
        {s for a in pretrain_parser()._actions for s in a.option_strings}  # training config: TrainConfig's
    for dest in shared:
        a, b = train[dest], pretrain[dest]
        assert (a.option_strings[0], a.type, a.choices, a.nargs, a.default, type(a)) == \
               (b.option_strings[0], b.type, b.choices, b.nargs, b.default, type(b)), dest
    # A field filled in by the entry point has no flag in either.
    for name in ("run_id", "data_dir", "storage_dir", "resume_path", "trackers", "started_at", "test_hooks"):
        assert name not in train and name not in pretrain


def test_flags_win_over_yaml_and_values_arrive_typed():
    yaml_values = {"keep_checkpoints": 5, "num_workers": "2-4", "cpus_per_worker": "auto",
                   "resources_per_worker": {"slot": 1}, "val_samples": 8}
    args = pretrain_parser().parse_args(["--keep-checkpoints", "7", "--cpus-per-worker", "2.5"])
    configs = build_configs(args, yaml_values, RayOptions)
    run = configs.run
    assert (run.keep_checkpoints, run.cpus_per_worker, run.resources_per_worker) == (7, 2.5, {"slot": 1.0})
    assert (run.workers, configs.train.val_samples, run.storage_path, run.max_failures) == ((2, 4), 8, "./runs", None)
    assert run.failures == ELASTIC_MAX_FAILURES > 0  # a range resizes by default; a fixed size does not:
    assert build_configs(pretrain_parser().parse_args(["--num-workers", "3"]), {}, RayOptions).run.failures == 0
    assert build_configs(pretrain_parser().parse_args(["--max-failures", "2"]), yaml_values, RayOptions).run.failures == 2
    assert build_configs(pretrain_parser().parse_args(["--resources-per-worker", "a=1,b=2"]), {},
                         RayOptions).run.resources_per_worker == {"a": 1.0, "b": 2.0}
    assert build_configs(pretrain_parser().parse_args([]), {"use_gpu": True}, RayOptions).run.use_gpu == "true"
    with pytest.raises(UsageError, match="^--use-gpu must be one of auto, true, false, got 'maybe'$"):
        build_configs(pretrain_parser().parse_args([]), {"use_gpu": "maybe"}, RayOptions)
    with pytest.raises(UsageError, match="unknown option.*num_workers"):  # a pretrain option in a minilm.train file
        build_configs(train_parser().parse_args([]), {"num_workers": 2}, LocalOptions)


@pytest.mark.parametrize("values,message", [
    ({"keep_checkpoints": 0}, "--keep-checkpoints must be an integer >= 1, got 0"),
    ({"keep_checkpoints": "3"}, "--keep-checkpoints must be an integer >= 1, got '3'"),
    ({"max_failures": -1}, "--max-failures must be an integer >= 0, got -1"),
    ({"exit_after_minutes": 0.0}, "--exit-after-minutes must be > 0, got 0.0"),
    ({"collective_timeout_s": float("nan")}, "--collective-timeout-s must be >= 1, got nan"),
    ({"exit_after_minutes": True}, "--exit-after-minutes must be > 0, got True"),  # YAML's `true`
    ({"exit_after_minutes": 10**400}, f"--exit-after-minutes must be a number below 1e300, got {10**400}"),
    ({"elastic_check_seconds": -10**400}, f"--elastic-check-seconds must be a number below 1e300, got {-10**400}"),
])
def test_a_bad_option_value_is_one_line_naming_its_flag(values, message):
    with pytest.raises(UsageError) as e:
        RayOptions(**values).validate()
    assert str(e.value) == message
    assert RayOptions().validate() == RayOptions()
    with pytest.raises(ConfigError, match="eval_every must be an integer >= 1, got True"):
        TrainConfig(eval_every=True).validate()


def test_a_null_or_empty_value_of_an_option_that_needs_one_is_one_line_naming_its_flag(tmp_path):
    """`resume: ~` (or `keep_checkpoints:` with nothing after it) in a config file: PyYAML reads None, which a flag
    cannot give. Each option whose type has no None is refused naming its flag and its default; the optional
    ones (`name: ~`) keep their default."""
    import typing

    from minilm.cli import load_yaml

    for cls, parser in ((LocalOptions, train_parser), (RayOptions, pretrain_parser)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.metadata.get("help"):
                continue
            (tmp_path / "c.yaml").write_text(f"{f.name}: ~\n")
            needs_one = type(None) not in typing.get_args(hints[f.name])
            try:
                build_configs(parser().parse_args([]), load_yaml(str(tmp_path / "c.yaml")), cls).run.validate()
            except UsageError as e:
                assert needs_one and str(e).startswith(f"--{f.name.replace('_', '-')} "), (f.name, str(e))
                assert "null" in str(e) or "None" in str(e), str(e)
            else:
                assert not needs_one or f.metadata["convert"], f"{f.name}: ~ was taken"
    for spelling in ("''", "' '"):
        (tmp_path / "c.yaml").write_text(f"resume: {spelling}\n")
        with pytest.raises(UsageError, match=r"^--resume must be auto, never or a checkpoint PATH, got '\s*'$"):
            build_configs(train_parser().parse_args([]), load_yaml(str(tmp_path / "c.yaml")), LocalOptions).run.validate()
    # end to end (one line and exit 2, not a TypeError from pathlib, as the fuzz test found): test_bad_config.py


def test_micro_batch_size_is_a_size_or_auto_from_a_flag_or_the_yaml(tmp_path):
    from minilm.cli import load_yaml

    for argv, yaml_text, want in ((["--micro-batch-size", "auto"], "", "auto"), (["--micro-batch-size", "8"], "", 8),
                                  ([], "micro_batch_size: auto\n", "auto"), ([], "micro-batch-size: 8\n", 8),
                                  ([], "micro_batch_size: '8'\n", 8)):
        (tmp_path / "c.yaml").write_text(yaml_text)
        train = build_configs(train_parser().parse_args(argv), load_yaml(str(tmp_path / "c.yaml")), LocalOptions).train
        assert train.validate().micro_batch_size == want and type(train.micro_batch_size) is type(want), argv
    assert "auto: on a GPU the largest" in {a.dest: a.help for a in train_parser()._actions}["micro_batch_size"]
    with pytest.raises(ConfigError, match="micro_batch_size must be an integer >= 1, or auto, got 'max'"):
        build_configs(train_parser().parse_args(["--micro-batch-size", "max"]), {}, LocalOptions).train.validate()


def test_plan_steps_matches_the_arithmetic_on_a_grid():
    grid = itertools.product(range(1, 14), (0, 1, 3), (2, 4, 6), (1, 2), (None, 1, 5), (1, 3), (0, 2), (1, 2, 3, 5))
    checked = 0
    for n, val, g, m, max_steps, epochs, warmup, world in grid:
        if val >= n:
            continue
        cfg = TrainConfig(global_batch_size=g, micro_batch_size=m, max_steps=max_steps, epochs=epochs,
                          warmup_steps=warmup)
        per_epoch = (n - val) // g
        total = max_steps if max_steps is not None else per_epoch * epochs
        if world > g:  # any world size up to one sequence per worker keeps the global batch
            expected = UsageError
        elif per_epoch == 0:
            expected = D.DataError
        elif warmup >= total:
            expected = ConfigError
        else:
            plan = plan_steps(dataclasses.replace(cfg, val_samples=val), n, (world,))
            assert (plan.steps_per_epoch, plan.total_steps) == (per_epoch, total)
            checked += 1
            continue
        with pytest.raises(expected):
            plan_steps(dataclasses.replace(cfg, val_samples=val), n, (world,))
    assert checked > 500


def test_plan_steps_names_what_does_not_fit():
    cfg = TrainConfig(global_batch_size=8, micro_batch_size=2)
    with pytest.raises(D.DataError, match="^data/x: 7 training sequences do not fill one global batch of 8$"):
        plan_steps(dataclasses.replace(cfg, val_samples=3), 10, where="data/x: ")
    assert plan_steps(cfg, 100, (2, 3, 8)).steps_per_epoch == 12  # uneven sizes take uneven slices
    with pytest.raises(UsageError, match="world size[(]s[)] 9 cannot keep .* valid world sizes: 1-8$"):
        plan_steps(cfg, 100, (2, 9))
    with pytest.raises(ConfigError, match=r"warmup_steps \(3\) must be smaller than the total optimizer steps \(3\)"):
        plan_steps(dataclasses.replace(cfg, warmup_steps=3, epochs=1), 24)


def test_one_dtype_table():
    assert DTYPES == ("auto", *TORCH_DTYPES)
    assert {DTYPE_NAMES[d]: d for d in DTYPE_NAMES} == TORCH_DTYPES
    assert DTYPE_NAMES[resolve_dtype("fp32", "cpu")] == "fp32"
    assert DTYPE_NAMES[resolve_dtype("auto", "cpu")] in ("fp32", "bf16")
    dtype_flag = next(a for a in train_parser()._actions if a.dest == "dtype")
    assert dtype_flag.choices == list(DTYPES) and TORCH_DTYPES["bf16"] is torch.bfloat16


def test_the_driver_start_line_shows_the_storage_without_its_secrets(monkeypatch, capsys):
    from types import SimpleNamespace

    from ray_jobs import pretrain

    opts = RayOptions(name="r1", storage_path="s3://AKIAX:hunter2@bucket/runs?secret_key=hunter2&region=x",
                      data_dir="s3://bucket/data?access_key=AKIAX", cpus_per_worker=1.0)
    plan = pretrain.RunPlan(None, None, opts, SimpleNamespace(num_sequences=64), None)
    plan.steps = SimpleNamespace(steps_per_epoch=4)
    monkeypatch.setattr(pretrain, "plan_run", lambda args: plan)
    monkeypatch.setattr(pretrain, "make_trainer", lambda config, opts: SimpleNamespace(fit=lambda: None))
    monkeypatch.setattr(pretrain, "quiet_console", lambda plan: SimpleNamespace(installed=False))
    monkeypatch.setattr(pretrain, "worker_config", lambda plan: {})
    monkeypatch.setattr(pretrain.RunPlan, "release", lambda self: None)
    monkeypatch.setattr(pretrain, "summarize", lambda *a: None)
    assert pretrain.run(None) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith("run r1: storage s3://***@bucket/runs/r1?secret_key=***&region=x, "
                           "data s3://bucket/data?access_key=*** (64 sequences, 4 steps per epoch)"), line
    assert "hunter2" not in line and "AKIAX" not in line
