"""Fault injection stays out of a user's run: MINILM_TEST_* act only under MINILM_TESTING=1 (announced), travel to
the workers in the run's config, and no MINILM_TEST_* variable is forwarded to a worker's environment."""

from __future__ import annotations

import pytest

from minilm import testing
from minilm.testing import FaultHooks


def test_hooks_without_the_switch_are_ignored_with_a_note():
    said = []
    hooks = testing.from_env({"MINILM_TEST_HOLD_FILE": "/tmp/left-behind", "MINILM_TEST_STEP_DELAY_S": "5"},
                             warn=said.append)
    assert hooks is None
    assert said == ["note: ignoring MINILM_TEST_HOLD_FILE, MINILM_TEST_STEP_DELAY_S: fault injection is only for "
                    "the test suite (it needs MINILM_TESTING=1)"]
    assert testing.from_env({}, warn=said.append) is None and len(said) == 1  # nothing set: nothing said


def test_hooks_with_the_switch_are_announced_and_round_trip_through_the_run_config():
    said = []
    hooks = testing.from_env({"MINILM_TESTING": "1", "MINILM_TEST_NAN_AT_STEPS": "5,6", "MINILM_TEST_STEP_DELAY_S": "0.5"},
                             warn=said.append)
    assert hooks == FaultHooks(nan_at_steps=(5, 6), step_delay_s=0.5)
    assert said == ["warning: MINILM_TESTING=1: fault injection is ON for this run: step_delay_s=0.5, "
                    "nan_at_steps=(5, 6)"]
    assert FaultHooks.from_dict(hooks.to_dict()) == hooks
    assert FaultHooks.from_dict(None) is None and FaultHooks().active() == {}


def test_an_unknown_hook_is_refused():
    with pytest.raises(ValueError, match="unknown test hook"):
        testing.from_env({"MINILM_TESTING": "1", "MINILM_TEST_TYPO": "1"})


def test_no_test_variable_reaches_a_worker(monkeypatch):
    from ray_jobs.cli import RayOptions as RunOptions
    from ray_jobs.pretrain import worker_env

    monkeypatch.setenv("MINILM_TESTING", "1")
    monkeypatch.setenv("MINILM_TEST_HOLD_FILE", "/tmp/hold")
    monkeypatch.setenv("MINILM_CACHE", "/tmp/cache")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_API_KEY", "secret")
    env = worker_env(RunOptions(cpus_per_worker=2.0))
    assert env == {"OMP_NUM_THREADS": "2", "TORCHINDUCTOR_COMPILE_THREADS": "2", "MINILM_CACHE": "/tmp/cache",
                   "WANDB_MODE": "offline"}


def test_the_default_hooks_do_nothing(tmp_path):
    """What a run without hooks executes every step: no sleep, no file, no gradient hook."""
    import time

    import torch

    hooks = FaultHooks()
    t0 = time.perf_counter()
    hooks.after_step(3, 0, 1, [1, 2])
    assert time.perf_counter() - t0 < 0.01 and not list(tmp_path.iterdir())
    model = torch.nn.Module()
    model.lm_head = torch.nn.Linear(2, 2)
    with hooks.nonfinite_gradients(3, model):
        assert not model.lm_head.weight._backward_hooks
    hooks.before_checkpoint_file(8, "optimizer.pt")
    hooks.before_marker(tmp_path, 8)
