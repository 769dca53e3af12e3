"""A non-finite loss or gradient norm at optimizer step k: the step is skipped and counted; K in a row stop
the run naming the steps. (Unit tests of NaN/inf gradients and an inf loss: tests/test_step.py.)"""

from __future__ import annotations

import pytest
from runs import error_lines, metrics, pretrain, tiny_args

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


def test_a_nan_step_is_skipped_and_counted(ray_address, run_data, run_storage):
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "nan1", "--num-workers", "2", steps=8),
                    MINILM_TEST_NAN_AT_STEPS="5")
    records = metrics(run_storage / "nan1")
    assert records[-1]["optimizer_step"] == 8 and records[-1]["skipped_steps"] == 1
    assert "skipped 1" in proc.stdout


def test_nan_steps_in_a_row_stop_the_run_naming_the_steps(ray_address, run_data, run_storage):
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "nan3", "--num-workers", "2",
                                           "--max-nonfinite-steps", "3", steps=12),
                    check=False, MINILM_TEST_NAN_AT_STEPS="5,6,7")
    assert proc.returncode == 1, proc.stderr[-2000:]
    error = error_lines(proc.stderr)
    assert len(error) == 1, proc.stderr[-3000:]
    assert "3 optimizer steps in a row (5..7) had a non-finite loss or gradient norm" in error[0]
