"""NaN steps in a row stop a Ray run with one error line naming the steps (through Ray's error wrapper). A single
skipped step, and the stop without Ray: tests/test_trainer.py; the guard itself: tests/test_step.py."""

from __future__ import annotations

import pytest
from helpers import error_lines
from runs import pretrain, tiny_args

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.mark.slow  # a Ray run to its stop (the Trainer's NaN logic without Ray: tests/test_trainer.py)
def test_nan_steps_in_a_row_stop_the_run_naming_the_steps(ray_address, run_data, run_storage):
    proc = pretrain(ray_address, tiny_args(run_data, run_storage, "nan3", "--num-workers", "2",
                                           "--max-nonfinite-steps", "3", steps=12),
                    check=False, MINILM_TEST_NAN_AT_STEPS="5,6,7")
    assert proc.returncode == 1, proc.stderr[-2000:]
    error = error_lines(proc.stderr)
    assert len(error) == 1, proc.stderr[-3000:]
    assert error[0].startswith("error: training failed: NonFiniteLossError: stopping: 3 optimizer steps in a row "
                               "(5..7) had a non-finite loss or gradient norm")
