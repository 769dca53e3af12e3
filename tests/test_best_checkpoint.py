"""The best checkpoint (minilm.checkpoint.best, issue #36): which way each metric improves, when best.json changes,
that pruning keeps the best and the pending checkpoints, and RUN/best in ray_jobs.export, minilm.sample and
ray_jobs.evaluate, with one error line when there is no best or it is gone. No Ray: tiny checkpoints written here."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file
from test_evaluate import tiny_model, write_checkpoint

from minilm import checkpoint as C
from minilm import sample
from minilm.cli import UsageError
from minilm.config import TrainConfig
from minilm.tokenizer import BOS_ID, save_tokenizer, train_tokenizer
from ray_jobs import evaluate, export

SENTENCES = ["the cat sleeps on the mat.", "the dog sleeps in the barn.", "the fox sleeps under the tree."]


# ---- which way a metric improves ----------------------------------------------------------------------

@pytest.mark.parametrize("metric, name, mode", [
    ("eval/held/bpb", "eval/held/bpb", "min"),
    ("held/bpb", "eval/held/bpb", "min"),
    ("eval/held/nats_per_token", "eval/held/nats_per_token", "min"),
    ("eval/train/loss", "eval/train/loss", "min"),
    ("eval/val/val_loss", "eval/val/val_loss", "min"),
    ("val/val_bpb", "eval/val/val_bpb", "min"),
    ("eval/hellaswag/acc", "eval/hellaswag/acc", "max"),
    ("hellaswag/acc_norm", "eval/hellaswag/acc_norm", "max"),
    ("eval/mmlu/mc_acc", "eval/mmlu/mc_acc", "max"),
    ("mmlu/astronomy/acc", "eval/mmlu/astronomy/acc", "max"),  # a task name may hold a '/'
    ("eval/mmlu/astronomy/acc", "eval/mmlu/astronomy/acc", "max"),
    ("eval/bpb", "eval/eval/bpb", "min"),  # <task>/<metric> with a task named eval
])
def test_the_metric_name_says_which_way_is_better(metric, name, mode):
    assert C.canonical(metric) == (name, mode)


@pytest.mark.parametrize("metric", ["eval/held/prompts", "eval/held/accuracy", "eval/held/acc_norm2",
                                    "eval/held/BPB", "eval/held/bpb_", "eval/held/", "bpb", "acc", "", "/bpb",
                                    "eval/held/seconds", "eval/held/items"])
def test_any_other_metric_is_one_line(metric):
    with pytest.raises(C.MetricError) as e:
        C.canonical(metric)
    assert isinstance(e.value, ValueError) and isinstance(e.value, UsageError)
    assert repr(metric) in str(e.value) and "\n" not in str(e.value)


# ---- when best.json changes ----------------------------------------------------------------------------

def update(folder, metric, step, value, sha="0" * 64) -> bool:
    """`update_best` with checkpoint_<step>; `sha`: by default the weights' SHA-256 in the markers `marked` writes."""
    return C.update_best(folder, metric, f"checkpoint_{step:08d}", step, value, sha)


def marked(run, *steps: int) -> None:
    """Checkpoint folders with a marker (complete as far as pruning and best.json look)."""
    for step in steps:
        (run / f"checkpoint_{step:08d}").mkdir(parents=True)
        (run / f"checkpoint_{step:08d}" / C.MARKER).write_text(json.dumps({"files": {"model.safetensors": "0" * 64}}))


def test_a_checkpoint_becomes_best_only_when_strictly_better(tmp_path):
    folder = C.RunFolder(tmp_path)
    marked(tmp_path, *range(4, 36, 4))
    assert C.read_best(folder) is None
    assert not update(folder, "held/bpb", 2, math.nan)  # NaN never becomes best, not even the first
    assert not update(folder, "held/bpb", 2, math.inf) and C.read_best(folder) is None
    assert update(folder, "held/bpb", 4, 1.5)  # the first
    best = C.read_best(folder)
    assert {k: best[k] for k in ("checkpoint", "step", "metric", "mode", "value", "weights_sha256")} == \
        {"checkpoint": "checkpoint_00000004", "step": 4, "metric": "eval/held/bpb", "mode": "min", "value": 1.5,
         "weights_sha256": "0" * 64}
    assert update(folder, "eval/held/bpb", 8, 1.25)  # better (lower), the other spelling of the metric
    assert not update(folder, "held/bpb", 12, 1.25)  # equal: the earlier one stays
    assert not update(folder, "held/bpb", 16, 1.5)  # worse
    assert not update(folder, "held/bpb", 20, math.nan)
    assert C.read_best(folder)["checkpoint"] == "checkpoint_00000008"
    # another metric replaces the pointer whatever its value, then goes by its own direction (higher is better)
    assert update(folder, "eval/facts/acc", 24, 0.25)
    assert C.read_best(folder)["mode"] == "max" and C.read_best(folder)["step"] == 24
    assert not update(folder, "facts/acc", 28, 0.2) and not update(folder, "facts/acc", 28, 0.25)
    assert update(folder, "facts/acc", 32, 0.5) and C.read_best(folder)["value"] == 0.5
    with pytest.raises(C.MetricError):
        update(folder, "facts/prompts", 36, 1.0)
    assert not list(tmp_path.glob("*.tmp-*"))  # written atomically


def test_a_best_checkpoint_no_longer_in_the_folder_is_replaced_by_the_next_score(tmp_path):
    """--abandon-newer moved the best aside, or its step was written again: the next score replaces it, worse or not."""
    folder = C.RunFolder(tmp_path)
    marked(tmp_path, 4, 8, 12)
    assert update(folder, "held/bpb", 4, 1.0) and not update(folder, "held/bpb", 8, 2.0)
    (tmp_path / "checkpoint_00000004" / C.MARKER).write_text(json.dumps({"files": {"model.safetensors": "1" * 64}}))
    assert update(folder, "held/bpb", 8, 2.0)  # 4 holds other weights now
    folder.move_aside(["checkpoint_00000008"])
    assert update(folder, "held/bpb", 12, 3.0) and C.read_best(folder)["step"] == 12


DAMAGED = [  # best.json's text, or a good one's fields changed
    ("{not json", "is unreadable"),
    ("[1, 2]", "is not a mapping"),
    ('{"step": 4}', "checkpoint must be a string, got nothing"),
    ({"step": True}, "step must be an integer, got True"),
    ({"value": "0.5"}, "value must be a number, got '0.5'"),
    ({"checkpoint": "../../etc"}, "is not a checkpoint_XXXXXXXX folder name"),
    ({"checkpoint": "checkpoint_00000004/.."}, "is not a checkpoint_XXXXXXXX folder name"),
    ({"mode": "max"}, "do not agree"),
    ({"metric": "held/bpb"}, "do not agree"),  # not in its canonical spelling: not written by minilm
    ({"value": math.nan}, "do not agree"),
    ({"metric": "eval/held/prompts"}, "cannot choose the best checkpoint"),
]


def damage(folder: C.RunFolder, change: str | dict) -> None:
    if isinstance(change, dict):
        update(folder, "held/bpb", 4, 1.0)
        change = json.dumps({**C.read_best(folder), **change})
    (folder.local / C.BEST).write_text(change)


@pytest.mark.parametrize("change, what", DAMAGED)
def test_a_damaged_best_json_is_one_line_naming_it(tmp_path, change, what):
    folder = C.RunFolder(tmp_path)
    damage(folder, change)
    for read in (C.read_best, C.pinned, lambda f: update(f, "held/bpb", 8, 0.5)):
        with pytest.raises(C.CheckpointError) as e:
            read(folder)
        assert str(e.value).startswith(f"{tmp_path}/{C.BEST}") and what in str(e.value), str(e.value)
        assert "\n" not in str(e.value)


# ---- pruning keeps the pinned checkpoints -----------------------------------------------------------------

def test_prune_keeps_the_best_and_the_pending_besides_the_newest(tmp_path):
    run, said = tmp_path / "run", []
    marked(run, 4, 8, 12, 16, 20, 24)
    folder = C.RunFolder(run)
    update(folder, "held/bpb", 8, 1.0)
    C.write_pending(folder, ["checkpoint_00000012", "checkpoint_00000099"])
    assert C.read_pending(folder) == {"checkpoint_00000012", "checkpoint_00000099"}
    assert C.pinned(folder) == {"checkpoint_00000008", "checkpoint_00000012", "checkpoint_00000099"}
    manager = C.CheckpointManager(C.LocalStorage(run), TrainConfig(), rank=0, device=torch.device("cpu"), keep=2,
                                  say=said.append)
    assert manager.prune("checkpoint_00000024") == ["checkpoint_00000004", "checkpoint_00000016"]
    assert folder.checkpoints() == ["checkpoint_00000008", "checkpoint_00000012", "checkpoint_00000020",
                                    "checkpoint_00000024"]
    # evaluated: no longer pending, and not the best: the next prune deletes it
    C.write_pending(folder, [])
    marked(run, 28)
    assert manager.prune("checkpoint_00000028") == ["checkpoint_00000012", "checkpoint_00000020"]
    # a damaged pending file pins nothing (it chooses nothing); the best stays pinned
    (run / C.PENDING).write_text('{"checkpoints": "checkpoint_00000024"')
    assert C.read_pending(folder) == set()
    marked(run, 32)
    assert manager.prune("checkpoint_00000032") == ["checkpoint_00000024"]
    # a damaged best.json: nothing is deleted, with a warning
    (run / C.BEST).write_text("{")
    marked(run, 36)
    assert manager.prune("checkpoint_00000036") == []
    assert folder.checkpoints() == ["checkpoint_00000008", "checkpoint_00000028", "checkpoint_00000032",
                                    "checkpoint_00000036"]
    assert said == [f"warning: not pruning old checkpoints: {run}/{C.BEST} is unreadable (Expecting property name "
                    f"enclosed in double quotes: line 1 column 2 (char 1)): fix or delete it (the next evaluation "
                    f"writes it again)"]


@pytest.mark.parametrize("text", ["", "{", "[]", '{"checkpoints": 3}', '{"checkpoints": ["../x", 4]}'])
def test_a_damaged_pending_file_pins_nothing(tmp_path, text):
    (tmp_path / C.PENDING).write_text(text)
    assert C.read_pending(C.RunFolder(tmp_path)) == C.pinned(C.RunFolder(tmp_path)) == set()


# ---- RUN/best in export, sample and evaluate ----------------------------------------------------------------

@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder of two checkpoints, the best the older one (2, without weights/); 4 has weights/ with the
    run's tokenizer. Read only: each test that changes best.json makes its own run folder."""
    root = tmp_path_factory.mktemp("best")
    tok_path = save_tokenizer(train_tokenizer(SENTENCES * 4, 300), root / "tokenizer.json")
    run = root / "run1"
    for step, seed in ((2, 1), (4, 2)):
        write_checkpoint(run / f"checkpoint_{step:08d}", tiny_model(seed), tok_path, step)
    four = tiny_model(2)
    C.write_weights_export(run / "checkpoint_00000004" / "weights", C.model_tensors(four.state_dict()), four.config,
                           tok_path, in_place=True)
    folder = C.RunFolder(run)
    for step, value in ((2, 1.25), (4, 1.5)):
        ckpt = run / f"checkpoint_{step:08d}"
        C.update_best(folder, "held/bpb", ckpt.name, step, value, C.file_sha256(ckpt / "model.safetensors"))
    return run


def test_resolve_turns_run_best_into_the_checkpoint_and_leaves_other_paths(run, tmp_path):
    assert C.resolve(str(run / "best")) == str(run / "checkpoint_00000002")
    for other in (str(run / "checkpoint_00000004"), str(run), "nowhere/best", str(tmp_path / "best")):
        assert C.resolve(other) == other  # (an ordinary folder without best.json: its own "does not exist")
    (tmp_path / "best").mkdir()  # a folder that is really named best
    (tmp_path / C.BEST).write_text("{")
    assert C.resolve(str(tmp_path / "best")) == str(tmp_path / "best")


def test_export_of_run_best_writes_the_best_steps_weights(run, tmp_path, capsys):
    assert export.main(["--checkpoint", str(run / "best"), "--output", str(tmp_path / "out"), "--dtype", "fp32"]) == 0
    assert "weights: " in capsys.readouterr().out
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    best = load_file(str(run / "checkpoint_00000002" / "model.safetensors"))
    other = load_file(str(run / "checkpoint_00000004" / "model.safetensors"))
    assert got.keys() == best.keys() and all(torch.equal(got[k], best[k]) for k in best)
    assert not all(torch.equal(got[k], other[k]) for k in other)


def test_sample_of_run_best_prints_the_best_models_text(run, capsys):
    """Checkpoint 2 has no weights/: its fp32 weights, with the tokenizer of checkpoint 4's weights/."""
    model = tiny_model(1)  # checkpoint 2's
    tok = sample.load(str(run / "checkpoint_00000004" / "weights"))[1]
    ids = torch.tensor([[BOS_ID, *tok.encode("the cat").ids]])
    # greedy; then sampled with a seed, which tells the two checkpoints apart (a greedy tiny random model repeats
    # its prompt's last token)
    for argv, kwargs in ((["--temperature", "0"], {"temperature": 0}),
                         (["--temperature", "1", "--top-p", "1", "--seed", "3"],
                          {"temperature": 1.0, "top_p": 1.0, "generator": torch.Generator().manual_seed(3)})):
        argv = ["--prompt", "the cat", "--max-new-tokens", "12", *argv]
        assert sample.main(["--checkpoint", str(run / "best"), *argv]) == 0
        printed = capsys.readouterr().out
        out = model.generate(ids, max_new_tokens=12, eos_token_id=model.config.eos_token_id, **kwargs)
        assert printed == tok.decode(out[0, 1:].tolist()) + "\n" and printed.startswith("the cat")
    assert sample.main(["--checkpoint", str(run / "checkpoint_00000004"), *argv]) == 0
    assert capsys.readouterr().out != printed


def test_sample_of_a_best_with_a_weights_export_uses_it(run, tmp_path, capsys):
    """Here the checkpoint's weights/ holds other weights than its model.safetensors, to tell which is sampled."""
    tok_path = run.parent / "tokenizer.json"
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoint_00000004", tiny_model(2), tok_path, 4)
    other = tiny_model(3)
    C.write_weights_export(ckpt / "weights", C.model_tensors(other.state_dict()), other.config, tok_path,
                           in_place=True)
    C.update_best(C.RunFolder(ckpt.parent), "held/bpb", ckpt.name, 4, 1.0, C.file_sha256(ckpt / "model.safetensors"))
    # sampled (seeded): a greedy tiny random model repeats its prompt's last token, whatever its weights
    argv = ["--prompt", "the dog", "--temperature", "1", "--top-p", "1", "--max-new-tokens", "12"]
    texts = []
    for weights in (ckpt.parent / "best", ckpt / "weights", run / "checkpoint_00000004"):  # the last: tiny_model(2)
        assert sample.main(["--checkpoint", str(weights), *argv]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] != texts[2], texts


def test_evaluate_of_run_best_scores_the_best_checkpoint(run, tmp_path, capsys):
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    (tmp_path / "tasks.yaml").write_text("tasks:\n  - {name: held, kind: bpb, path: held.jsonl}\n")
    out = tmp_path / "eval.jsonl"
    assert evaluate.main(["--checkpoint", str(run / "best"), "--tasks", str(tmp_path / "tasks.yaml"),
                          "--output", str(out)]) == 0
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    assert record["checkpoint"] == str(run / "checkpoint_00000002") and record["step"] == 2


# ---- the one writer protocol of the evaluation state (#44 class 2) ----------------------------------------------

def test_a_score_landing_between_prunings_two_reads_keeps_the_new_best(tmp_path, monkeypatch):
    """A deterministic interleaving: right after pruning's first read of the evaluation state, an evaluator writes
    checkpoint 12's (better) score and unpins it. Whichever file pruning reads first, 12 is pinned: the evaluator
    unpins only after best.json names it, and pinned() reads the pending list before best.json."""
    from minilm.checkpoint import best as B

    run = tmp_path / "run"
    marked(run, 8, 12)
    folder = C.RunFolder(run)
    update(folder, "held/bpb", 8, 2.0)
    C.write_pending(folder, ["checkpoint_00000012"])  # handed out for scoring
    landed = []

    def interleaved(real):
        def read(*args):
            result = real(*args)
            if not landed:  # the evaluator's whole step, between pruning's two reads (once: it reads best.json too)
                landed.append(None)
                landed[0] = update(folder, "held/bpb", 12, 1.0)
                C.write_pending(folder, [], scored=("checkpoint_00000012",))
            return result
        return read

    monkeypatch.setattr(B, "read_best", interleaved(B.read_best))
    monkeypatch.setattr(B, "read_pending", interleaved(B.read_pending))
    assert "checkpoint_00000012" in B.pinned(folder) and landed == [True]


def test_two_evaluators_keep_each_others_pins_and_a_failed_scoring_stays_pinned(tmp_path, monkeypatch):
    """The driver's evaluator and `evaluate --follow` each replace only their own list; a checkpoint scored by one
    leaves every list; one whose scoring failed is no score (scored_checkpoints) and stays pinned until scored."""
    from minilm.checkpoint import best as B

    run = tmp_path / "run"
    marked(run, 4, 8, 12)
    folder = C.RunFolder(run)
    monkeypatch.setattr(B, "owner", lambda: "driver")
    C.write_pending(folder, ["checkpoint_00000004", "checkpoint_00000008"])
    monkeypatch.setattr(B, "owner", lambda: "follow")
    C.write_pending(folder, ["checkpoint_00000012"])
    assert C.read_pending(folder) == {"checkpoint_00000004", "checkpoint_00000008", "checkpoint_00000012"}
    C.write_pending(folder, [], scored=("checkpoint_00000008",))  # follow scored 8 (and 12)
    monkeypatch.setattr(B, "owner", lambda: "driver")
    assert C.read_pending(folder) == {"checkpoint_00000004"}
    assert (run / B.EVAL_LOCK).is_file()
    (run / "eval.jsonl").write_text(
        json.dumps({"task": "held", "checkpoint": "checkpoint_00000004", "step": 4, "error": "lost node"}) + "\n" +
        json.dumps({"task": "held", "checkpoint": "checkpoint_00000008", "step": 8, "metrics": {"bpb": 1.0},
                    "weights_sha256": "0" * 64}) + "\n")
    assert C.scored_checkpoints(folder) == {"checkpoint_00000008"}
