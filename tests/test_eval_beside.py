"""Checkpoints scored beside training (`ray_jobs.pretrain --eval-tasks`): rank 0's reader of eval.jsonl (each score
forwarded once, at its checkpoint's step, never one of a step about to be redone), the flags' checks, the demo's task
list, and end to end: the final weights bitwise those of the run without evaluation, every checkpoint scored once,
the scores those of a plain log_softmax computed here, and a driver SIGKILLed and resubmitted scoring each checkpoint
once all the same."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from helpers import assert_quoted, bitwise_equal, metrics, quoted_block, wait_for
from runs import (
    STEPS,
    final_weights,
    is_complete,
    pretrain,
    start_pretrain,
    tiny_args,
    wait_until_workers_exit,
)
from test_evaluate import reference_loglik

from minilm import checkpoint as C
from minilm.eval_log import EvalInbox, append_records, eval_metrics, read_records, scored_keys
from minilm.tasks import load_tasks, read_hellaswag
from ray_jobs import demo_tasks
from ray_jobs.cli import UsageError, parse_eval_resources
from ray_jobs.evaluator import check_best_metric


def record(step: int, task: str, kind: str = "hellaswag", **metrics) -> dict:
    return {"task": task, "kind": kind, "step": step, "fingerprint": f"fp-{task}", "weights_sha256": f"w{step}",
            "metrics": metrics or {"acc": 0.5, "acc_norm": 0.25}}


def held(*steps: int):
    """The run folder's checkpoints as EvalInbox sees them: {name: weights SHA-256}, the weights `record` names."""
    return lambda: {f"checkpoint_{s:08d}": f"w{s}" for s in steps}


def append(path, *records, torn: str = "") -> None:
    with open(path, "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records) + torn)


# ---- rank 0's reader --------------------------------------------------------------------------------

def test_each_score_is_forwarded_once_at_its_step_and_none_of_a_step_to_be_redone(tmp_path):
    inbox = EvalInbox(tmp_path, ["cloze", "held"], metrics_records=[], weights=held(4, 8))
    assert inbox.poll(10) == []  # no eval.jsonl yet
    append(tmp_path / "eval.jsonl", record(4, "cloze"), record(4, "held", "bpb", bpb=1.5, nats_per_token=2.0),
           torn='{"task": "cloze", "step": 8, "kind": "hellaswag"')  # a line still being written is not read
    assert inbox.poll(6) == [
        {"optimizer_step": 4, "eval_task": "cloze", "weights_sha256": "w4", "eval/cloze/acc": 0.5,
         "eval/cloze/acc_norm": 0.25},
        {"optimizer_step": 4, "eval_task": "held", "weights_sha256": "w4", "eval/held/bpb": 1.5,
         "eval/held/nats_per_token": 2.0}]
    assert inbox.poll(6) == [] and inbox.scored([4]) and not inbox.scored([8])
    assert inbox.latest == {"eval/cloze/acc": 0.5, "eval/cloze/acc_norm": 0.25, "eval/held/bpb": 1.5,
                            "eval/held/nats_per_token": 2.0}
    with open(tmp_path / "eval.jsonl", "a") as f:  # the torn line ends; the scores of step 8 come while at step 6
        f.write(', "fingerprint": "x", "weights_sha256": "w8", "metrics": {"acc": 1.0, "acc_norm": 1.0}}\n')
    assert inbox.poll(6) == []  # step 8 is after the step the run is at: held back (a restart redoes it)
    assert inbox.poll(8) == [{"optimizer_step": 8, "eval_task": "cloze", "weights_sha256": "w8",
                              "eval/cloze/acc": 1.0, "eval/cloze/acc_norm": 1.0}]
    # A restarted rank 0 knows what metrics.jsonl holds (here without weights: an older minilm's): only the rest
    again = EvalInbox(tmp_path, ["cloze", "held"], weights=held(4, 8), metrics_records=[
        {"optimizer_step": 4, "eval_task": "cloze"}, {"optimizer_step": 4, "eval_task": "held"}, {"loss": 1.0,
                                                                                                  "optimizer_step": 4}])
    assert [(r["optimizer_step"], r["eval_task"]) for r in again.poll(20)] == [(8, "cloze")]


def test_the_eval_log_refuses_a_stranger_and_a_torn_line_ends_before_the_next_record(tmp_path):
    log = tmp_path / "eval.jsonl"
    append(log, record(4, "cloze"), {**record(6, "cloze"), "error": "boom"})
    assert scored_keys(log) == {(4, "w4", "fp-cloze")}  # an error is tried again
    append(log, torn='{"task": "cloze", "step": 8')  # a killed writer's torn line: rank 0 never reads it
    assert len(read_records(log)[0]) == 2
    assert scored_keys(log) == {(4, "w4", "fp-cloze")}  # nor does a resubmit refuse it: it is recovered (#44)
    (tmp_path / "stranger.jsonl").write_text(json.dumps(record(4, "cloze")) + "\nnot json\n")
    with pytest.raises(UsageError, match=r"stranger\.jsonl:2: not a record of ray_jobs\.evaluate"):
        scored_keys(tmp_path / "stranger.jsonl")
    append_records(log, [record(8, "c\u2028loze")], done := set())  # the torn line is ended first: it stays whole
    assert done == {(8, "w8", "fp-c\u2028loze")}
    assert [r["task"] for r in read_records(log)[0]] == ["cloze", "cloze", "c\u2028loze"]


def test_errors_and_generations_are_scored_but_carry_no_metric(tmp_path):
    gen = record(4, "samples", "generate", prompts=2)
    err = {**record(4, "cloze"), "error": "RuntimeError: boom"}
    del err["metrics"]
    assert eval_metrics(gen) == {} and eval_metrics(err) == {}
    assert eval_metrics(record(4, "held", "bpb", bpb=float("nan"), nats_per_token=2)) == {"eval/held/nats_per_token": 2.0}
    append(tmp_path / "eval.jsonl", gen, err)
    inbox = EvalInbox(tmp_path, ["samples", "cloze"], [], weights=held(4))
    assert inbox.wait_for([4], timeout_s=5) == [] and inbox.scored([4])  # nothing to forward, nothing to wait for


def test_the_wait_for_the_last_scores_ends_when_they_arrive_or_at_its_limit(tmp_path):
    inbox = EvalInbox(tmp_path, ["cloze"], [], weights=held(20))
    assert inbox.wait_for([20], timeout_s=0.3, poll_s=0.1) == [] and not inbox.scored([20])
    append(tmp_path / "eval.jsonl", record(20, "cloze"))
    assert [r["optimizer_step"] for r in inbox.wait_for([20], timeout_s=60)] == [20]


# ---- the flags --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("spec", "want"), [("CPU=2", {"CPU": 2.0}), ("CPU=1,GPU=0.5", {"CPU": 1.0, "GPU": 0.5}),
                                            ({"CPU": 1, "eval_slot": 1}, {"CPU": 1.0, "eval_slot": 1.0})])
def test_eval_resources_parse(spec, want):
    assert parse_eval_resources(spec) == want


@pytest.mark.parametrize("spec", ["CPU", "CPU=0", "CPU=-1", "=2", "CPU=x", "CPU=inf", "CPU=nan"])
def test_bad_eval_resources_are_one_line(spec):
    with pytest.raises(UsageError, match=r"--eval-resources .*expected NAME=N with N > 0"):
        parse_eval_resources(spec)


def test_the_best_metric_is_a_score_of_the_task_list(tmp_path):
    listing, _ = write_task_list(tmp_path / "tasks")
    (tmp_path / "tasks" / "prompts.txt").write_text("the quick\n")
    with open(listing, "a") as f:
        f.write("  - {name: samples, kind: generate, path: prompts.txt}\n")
    tasks = load_tasks(listing)
    assert check_best_metric(None, tasks) == "eval/cloze/acc_norm"
    assert check_best_metric(None, [t for t in tasks if t.kind != "hellaswag"]) == "eval/held/bpb"
    assert check_best_metric(None, [t for t in tasks if t.kind == "generate"]) is None
    assert check_best_metric("held/bpb", tasks) == "eval/held/bpb"
    for bad in ("eval/cloze/bpb", "eval/nope/acc", "eval/samples/prompts", "acc"):
        with pytest.raises(UsageError, match=r"^--eval-best .*: not a score of the task list; choose from "
                                             r"eval/cloze/acc, eval/cloze/acc_norm, eval/held/bpb"):
            check_best_metric(bad, tasks)


@pytest.mark.slow  # ~6 s: reads the standard library's sources
def test_the_demo_task_list_reads_and_refuses_a_folder_of_other_files(tmp_path):
    listing = demo_tasks.write_tasks(tmp_path / "t", items=20, documents=5)
    tasks = {t.name: t for t in load_tasks(listing)}
    assert [t.kind for t in tasks.values()] == ["hellaswag", "bpb", "generate"]
    items = read_hellaswag(tmp_path / "t" / "cloze.jsonl")
    assert len(items) == 20 and all(len(it.choices) == 4 for it in items)
    assert len({it.label for it in items}) > 1  # the right ending is not always in one place
    assert len(tasks["comments"].items) == 5
    assert demo_tasks.write_tasks(tmp_path / "t", items=20, documents=5) == listing  # its own output: replaced
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert demo_tasks.main(["--output", str(tmp_path / "other")]) == 2
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine" and len(list((tmp_path / "other").iterdir())) == 1


def test_demo_tasks_never_replaces_a_users_own_task_files(tmp_path, capsys):
    """A folder holding the very names demo_tasks writes (a user's tasks.yaml and prompts.txt), without its marker,
    is not its earlier output: refused in one line, both files untouched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "tasks.yaml").write_text("tasks: [my own]\n")
    (mine / "prompts.txt").write_text("my prompt\n")
    assert demo_tasks.main(["--output", str(mine)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "holds other files" in err, err
    assert (mine / "tasks.yaml").read_text() == "tasks: [my own]\n" and (mine / "prompts.txt").read_text() == \
        "my prompt\n" and len(list(mine.iterdir())) == 2


# ---- end to end ---------------------------------------------------------------------------------------

TEXT = ["the quick brown fox jumps over the lazy dog", "the lazy dog sleeps", "a quick fox"]


def write_task_list(folder) -> tuple:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"ctx": "the quick brown", "endings": [" fox jumps", " dog sleeps", " lazy"], "label": 0},
            {"ctx": "the lazy", "endings": [" dog sleeps", " quick brown fox", " over"], "label": 0},
            {"ctx": "jumps over the", "endings": [" fox", " lazy dog", " quick"], "label": 1}]
    (folder / "cloze.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "held.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXT))
    (folder / "tasks.yaml").write_text("tasks:\n  - {name: cloze, kind: hellaswag, path: cloze.jsonl}\n"
                                       "  - {name: held, kind: bpb, path: held.jsonl}\n")
    return folder / "tasks.yaml", rows


def eval_pairs(run_dir) -> list[tuple[int, str]]:
    return eval_pairs_of(run_dir / "eval.jsonl")


def forwarded(run_dir) -> list[tuple[int, str]]:
    return sorted((r["optimizer_step"], r["eval_task"]) for r in metrics(run_dir) if "eval_task" in r)


CHECKPOINTS = range(4, STEPS + 1, 4)


# The model's vocabulary must hold the data's tokenizer (256 bytes and 3 special tokens) for the tasks' text
EVAL_VOCAB = ("--vocab-size", "320")


@pytest.mark.ray
@pytest.mark.slow  # 3 runs: one without evaluation, one scored beside and SIGKILLed, its resubmission
@pytest.mark.timeout(900)
def test_scores_beside_a_killed_and_resubmitted_driver_arrive_once_and_leave_the_weights_bitwise(
        ray_address, run_data, run_storage, tmp_path):
    listing, rows = write_task_list(tmp_path / "tasks")
    pretrain(ray_address, tiny_args(run_data, run_storage, "without", *EVAL_VOCAB))
    args = tiny_args(run_data, run_storage, "beside", *EVAL_VOCAB, "--eval-tasks", str(listing), "--eval-resources",
                     "CPU=1")
    run_dir, log = run_storage / "beside", tmp_path / "driver.log"
    proc = start_pretrain(ray_address, args, capture=False, log=log, MINILM_TEST_STEP_DELAY_S="1")
    wait_for(lambda: eval_pairs(run_dir) and is_complete(run_dir / "checkpoint_00000008"), proc,
             "a checkpoint was scored and checkpoint 8 was complete")
    proc.send_signal(signal.SIGKILL)  # later checkpoints: being scored, or not yet handed out
    proc.wait(30)
    wait_until_workers_exit()
    assert not (run_dir / f"checkpoint_{STEPS:08d}").exists()
    before = eval_pairs(run_dir)
    assert len(set(before)) == len(before)
    again = pretrain(ray_address, args)
    # Training never reads a score (and resumes exactly): the weights are the run's without evaluation, bit for bit
    assert bitwise_equal(final_weights(run_storage, "beside"), final_weights(run_storage, "without"))
    want = [(s, t) for s in CHECKPOINTS for t in ("cloze", "held")]
    assert eval_pairs(run_dir) == want, (before, again.stdout[-3000:])  # every checkpoint scored, once
    assert forwarded(run_dir) == want  # and in metrics.jsonl once, at its checkpoint's step
    last = {r["eval_task"]: r for r in metrics(run_dir) if r.get("optimizer_step") == STEPS and "eval_task" in r}
    assert set(last["cloze"]) >= {"eval/cloze/acc", "eval/cloze/acc_norm"} and "eval/held/bpb" in last["held"]
    # The last scores against a plain log_softmax over each choice, computed here from the final weights
    from minilm.tokenizer import load_tokenizer

    ckpt = run_dir / f"checkpoint_{STEPS:08d}"
    model, _ = C.load_pretrained(ckpt / "weights")
    model.float()
    tok = load_tokenizer(ckpt / "weights" / "tokenizer.json")
    final = C.load_resume_state(ckpt, keys=("model_config",))
    model.load_state_dict(final.model_state)  # the fp32 weights (the export is half precision)
    right = 0
    for row in rows:
        loglik = [reference_loglik(model, tok, row["ctx"], e) for e in row["endings"]]
        right += int(torch.tensor(loglik).argmax()) == row["label"]
    assert last["cloze"]["eval/cloze/acc"] == pytest.approx(right / len(rows))
    # The best checkpoint by the default metric (cloze's acc_norm) is kept, whatever pruning did
    best = C.read_best(C.RunFolder(run_dir))
    scores = {r["optimizer_step"]: r["eval/cloze/acc_norm"] for r in metrics(run_dir) if r.get("eval_task") == "cloze"}
    assert best["metric"] == "eval/cloze/acc_norm" and best["value"] == max(scores.values())
    assert scores[best["step"]] == best["value"] and (run_dir / best["checkpoint"]).is_dir()
    assert f"eval  step {STEPS}: cloze acc " in again.stdout
    console = log.read_text() + again.stdout
    assert [line for line in console.splitlines() if line.startswith("warning") and "fault injection" not in line] == []
    # docs/evaluation.md's lines (the demo's tasks, cloze and comments: here cloze and held)
    assert_quoted([line.replace("comments", "held") for line in quoted_block("docs/evaluation.md", "eval  step")],
                  console)


@pytest.mark.ray
@pytest.mark.slow  # ~15 s: Ray tasks scoring two checkpoints
@pytest.mark.timeout(300)
def test_evaluate_follow_scores_a_live_runs_checkpoints_as_they_appear_and_ends_with_it(ray_address, tmp_path):
    # A run that holds its lease (this test) writes two checkpoints, one after the other; `ray_jobs.evaluate --follow`
    # scores each by a Ray task as it appears, and ends once the run has released its lease.
    import subprocess
    import sys
    import time

    from conftest import run_env
    from helpers import ROOT
    from test_evaluate import SENTENCES, tiny_model, write_checkpoint

    from minilm.tokenizer import save_tokenizer, train_tokenizer

    tok = save_tokenizer(train_tokenizer(SENTENCES * 4 + TEXT, 300), tmp_path / "tokenizer.json")
    listing, _ = write_task_list(tmp_path / "tasks")
    run_dir, out = tmp_path / "run", tmp_path / "scores.jsonl"
    lease = C.Lease(C.RunFolder(run_dir), say=lambda m: None).take()
    write_checkpoint(run_dir / "checkpoint_00000001", tiny_model(seed=0), tok, 1)
    log = tmp_path / "follow.log"
    env = {k: v for k, v in run_env(ray_address).items() if k != "PYTHONUNBUFFERED"}  # as a Ray job's driver runs
    with open(log, "w") as f:  # a file, as a Ray job's log is: each line must reach it as it happens
        proc = subprocess.Popen([sys.executable, "-m", "ray_jobs.evaluate", "--run-dir", str(run_dir), "--follow",
                                 "--tasks", str(listing), "--output", str(out), "--tokenizer", str(tok)], cwd=ROOT,
                                env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: eval_pairs_of(out) == [(1, "cloze"), (1, "held")], proc, "checkpoint 1 was scored", timeout=120)
        write_checkpoint(run_dir / "checkpoint_00000002", tiny_model(seed=1), tok, 2)
        wait_for(lambda: "eval  step 2: cloze acc" in log.read_text(), proc, "checkpoint 2's line", timeout=120)
        time.sleep(3)  # the command still follows the live run
        assert proc.poll() is None
    finally:
        lease.release()
    assert proc.wait(60) == 0
    output = log.read_text()
    assert eval_pairs_of(out) == [(1, "cloze"), (1, "held"), (2, "cloze"), (2, "held")], output
    assert "following" in output and "eval  step 1: cloze acc" in output and "Traceback" not in output


def eval_pairs_of(path) -> list[tuple[int, str]]:
    lines = path.read_text().splitlines() if path.is_file() else []
    return sorted((r["step"], r["task"]) for r in map(json.loads, lines) if "error" not in r)
