"""What reaches the console of a run: minilm's tagged lines; Ray's routine chatter goes to the run's log file."""

from __future__ import annotations

from ray_jobs.console import TAG, ConsoleFilter, is_routine


def test_tagged_lines_reach_the_console_and_the_rest_the_log_file(tmp_path, capsys):
    console = ConsoleFilter(tmp_path / "ray-workers.log")
    console.handle({"pid": 123, "actor_name": "RayTrainWorker",
                    "lines": [TAG + "epoch 1/1 step 2/4 loss 5.0", "TrainingReport(checkpoint=None, metrics={...})"]})
    assert capsys.readouterr().out == "epoch 1/1 step 2/4 loss 5.0\n"
    assert (tmp_path / "ray-workers.log").read_text() == \
        "(RayTrainWorker pid=123) TrainingReport(checkpoint=None, metrics={...})\n"


def test_only_routine_raylet_messages_are_routed():
    spawn = "WARNING: 8 PYTHON worker processes have been started on node: 9ab4 with address: 192.0.2.2, ..."
    oom = "Task was killed due to the node running low on memory."
    assert is_routine({"pid": "raylet", "lines": [spawn]})
    assert not is_routine({"pid": "raylet", "lines": [oom]})  # a worker killed for memory stays on the console
    assert not is_routine({"pid": 77, "lines": [spawn]})
