"""bench.minimind's plumbing, against a stand-in MiniMind checkout (the figures mean nothing here; bench/RESULTS.md
has the runs against the real script): the script is run from a copy of the checkout with MiniMind's flags, its
half-precision weights are loaded into minilm's model and scored by the same scorer as minilm's run, a second
invocation reuses MiniMind's run, and the corpora are built as documented."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from helpers import run_module

from bench import minimind as B
from bench import minimind as C  # the corpora
from minilm.tokenizer import save_tokenizer, train_tokenizer

# The stand-in: MiniMind's command line, its output file (../out/pretrain_<hidden>.pth, fp16 state dict with
# MiniMind's keys), and a record of the flags it was given. It trains nothing.
STAND_IN = textwrap.dedent('''
    import argparse, json, os, sys, torch
    sys.path.insert(0, "{root}")
    from minilm.config import ModelConfig
    from minilm.model import MiniMindForCausalLM
    p = argparse.ArgumentParser()
    for flag in ("--epochs", "--batch_size", "--accumulation_steps", "--hidden_size", "--num_hidden_layers",
                 "--max_seq_len", "--num_workers", "--log_interval", "--save_interval"):
        p.add_argument(flag, type=int)
    for flag in ("--learning_rate", "--grad_clip"):
        p.add_argument(flag, type=float)
    for flag in ("--device", "--dtype", "--data_path"):
        p.add_argument(flag)
    a = p.parse_args()
    os.makedirs("../out", exist_ok=True)  # as MiniMind's script does (its --save_dir)
    torch.manual_seed(42)
    model = MiniMindForCausalLM(ModelConfig(hidden_size=a.hidden_size, num_hidden_layers=a.num_hidden_layers))
    torch.save({{k: v.half() for k, v in model.state_dict().items()}}, f"../out/pretrain_{{a.hidden_size}}.pth")
    json.dump(vars(a), open("../out/flags.json", "w"))
''')

TINY = ["--corpus", "demo", "--hidden-size", "32", "--num-hidden-layers", "1", "--seq-len", "32", "--batch-size", "2",
        "--steps", "4", "--held-out", "20", "--threads", "1"]


@pytest.fixture
def checkout(tmp_path):
    root = tmp_path / "minimind"
    for part in ("model", "dataset", "trainer", "out"):
        (root / part).mkdir(parents=True)
    save_tokenizer(train_tokenizer(["a small tokenizer for the stand-in of MiniMind"] * 20, 300),
                   root / "model" / "tokenizer.json")
    (root / "trainer" / "train_pretrain.py").write_text(STAND_IN.format(root=os.getcwd()))
    return root


@pytest.mark.ray
@pytest.mark.nightly  # two trainings of the bench side by side (~20-30 s)
def test_minimind_and_minilm_are_trained_on_the_same_documents_and_scored_alike(ray_address, checkout, tmp_path):
    env = {**os.environ, "MINILM_BENCH_RESULTS": str(tmp_path), "RAY_ADDRESS": ray_address}
    work = tmp_path / "work"
    args = [*TINY, "--minimind", str(checkout), "--work", str(work), "--runs", "minimind,minilm,ray"]
    proc = run_module("bench.minimind", args, env=env, timeout=300, check=True)
    result = json.loads((tmp_path / "minimind.json").read_text())
    runs = {r["run"]: r for r in result["results"]}
    assert list(runs) == ["minimind", "minilm", "ray"]
    assert runs["minimind"]["steps"] == runs["minilm"]["steps"] == runs["ray"]["steps"] == 4
    # the Ray job trained what minilm.train trained: the same documents, seed and flags
    assert runs["ray"]["ce"] == pytest.approx(runs["minilm"]["ce"], rel=1e-4)
    for r in runs.values():
        assert 0 < r["ce"] < 20 and 0 < r["bpb"] < 20 and r["train_s"] > 0
    flags = json.loads((work / "minimind" / "out" / "flags.json").read_text())
    assert flags["accumulation_steps"] == 1 and flags["batch_size"] == 2 and flags["max_seq_len"] == 33
    assert flags["epochs"] == 1 and flags["dtype"] == "float32" and flags["device"] == "cpu"
    cwork = next(work.glob("demo-seed42-*"))
    train_docs = [json.loads(line)["text"] for line in open(flags["data_path"])]
    assert len(train_docs) == 8 and flags["data_path"] == str(cwork / "train.jsonl")
    manifest = json.loads((cwork / "tok" / "manifest.json").read_text())
    assert manifest["documents_read"] == 8 and manifest["rows"] == "best-fit"  # minilm's default, same documents
    assert "ce / MiniMind" in proc.stdout
    # The curve: minilm's default run kept a checkpoint every step (4 steps, --curve 8), each scored; a stand-in that
    # trains nothing is reached at once, within minilm's own wall time
    assert [step for step, _, _ in runs["minilm"]["curve"]] == [1, 2, 3, 4]
    assert 0 < runs["minilm"]["to_minimind_s"] <= runs["minilm"]["curve"][0][1] < runs["minilm"]["train_s"]
    assert "minilm reaches MiniMind's final CE" in proc.stdout and "time to MM CE / MM wall" in proc.stdout
    assert "tokens/s / MM" in proc.stdout and "ray reaches MiniMind's final CE" in proc.stdout
    # The stand-in's weights are minilm's seeded init: MiniMind's score is that of an untrained model.
    assert runs["minimind"]["ce"] > runs["minilm"]["ce"]
    again = run_module("bench.minimind", [*args[:-1], "minimind"], env=env, timeout=120, check=True)
    assert "MiniMind's run reused" in again.stdout
    assert json.loads((tmp_path / "minimind.json").read_text())["results"][0]["ce"] == runs["minimind"]["ce"]


@pytest.mark.parametrize("args, message", [
    (["--minimind", "/nonexistent/minimind"], "error: --minimind /nonexistent/minimind: no such folder"),
    (["--minimind", "{tmp}", "--corpus", "wiki"], "error: --corpus: unknown corpus 'wiki'"),
    (["--minimind", "{tmp}", "--curve", "-1"], "error: --curve must be >= 0"),
    (["--minimind", "{tmp}", "--runs", "minimind,nanogpt"], "error: --runs: 'nanogpt': a run is minimind, or minilm or ray"),
    (["--minimind", "{tmp}"], "error: --minimind {tmp}: no model/ folder: not a MiniMind checkout"),
])
def test_bad_invocation_is_one_error_line(tmp_path, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = run_module("bench.minimind", [*TINY, "--work", str(tmp_path / "w"), *args],
                      env={**os.environ, "MINILM_BENCH_RESULTS": str(tmp_path)}, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith(message.replace("{tmp}", str(tmp_path)))


def test_kjv_corpora_group_verses_and_chapters(tmp_path):
    books = ["Ge", "Ex", "1Sa"]
    lines = [f"{b}{c}:{v} {'word ' * 40}{b} {c} {v}." for b in books for c in range(1, 41) for v in range(1, 11)]
    kjv = tmp_path / "kjv.txt"
    kjv.write_text("\n".join(lines) + "\n")
    passages = B.corpus_documents("kjv-passages", str(kjv))
    assert sum(p.count(".") for p in passages) == len(lines)  # every verse once
    shortest = min(len(line.split(" ", 1)[1]) for line in lines)
    assert all(len(p) < C.PASSAGE_CHARS + 2 * shortest + 20 for p in passages)  # closed once PASSAGE_CHARS is reached
    assert sum(len(p) >= C.PASSAGE_CHARS for p in passages) >= len(passages) // 2  # only a chapter's end is shorter
    chapters = B.corpus_documents("kjv-chapters", str(kjv))
    assert len(chapters) == 3 * -(-40 // C.CHAPTERS_PER_DOC)  # groups never cross a book
    assert chapters[0].count("\n\n") == C.CHAPTERS_PER_DOC - 1 and "Ge 1 1." in chapters[0]
    assert chapters[-1].endswith("1Sa 40 10.")
    with pytest.raises(B.BenchError, match="found 0 chapters"):
        bad = tmp_path / "bad.txt"
        bad.write_text("not the bible\n")
        B.corpus_documents("kjv-passages", str(bad))


def test_the_chinese_corpus_is_one_document_per_fortune_without_colour_escapes(tmp_path):
    (tmp_path / "chinese").write_text("要有礼貌\n\n请保持礼貌。\n    -- Debian\n%\n\x1b[1m善意推定\x1b[0m，请始终假设\n%\n短\n")
    (tmp_path / "tang300").write_text("床前明月光，疑是地上霜。\n举头望明月，低头思故乡。\n")
    (tmp_path / "song100").write_text("明月几时有？把酒问青天。\n%\n")
    assert C.zh_fortunes(tmp_path) == ["要有礼貌\n\n请保持礼貌。\n    -- Debian", "善意推定，请始终假设",
                                       "床前明月光，疑是地上霜。\n举头望明月，低头思故乡。", "明月几时有？把酒问青天。"]
    (tmp_path / "song100").unlink()
    with pytest.raises(B.BenchError, match="apt-get install fortunes-zh"):
        C.zh_fortunes(tmp_path)


def test_time_to_reach_a_loss_interpolates_between_checkpoints():
    curve = [(10, 20.0, 5.0), (20, 40.0, 4.0), (30, 60.0, 3.5)]
    assert B.time_to_reach(curve, 4.5) == pytest.approx(30.0)  # halfway from 5.0 to 4.0
    assert B.time_to_reach(curve, 4.0) == 40.0 and B.time_to_reach(curve, 3.5) == 60.0
    assert B.time_to_reach(curve, 6.0) == 20.0  # reached by the first checkpoint: at most its time
    assert B.time_to_reach(curve, 3.0) is None and B.time_to_reach([], 1.0) is None


def test_the_ce_at_a_wall_time_is_read_off_the_curve_and_never_extrapolated():
    curve = [(10, 20.0, 5.0), (20, 40.0, 4.0), (30, 60.0, 3.5)]
    assert B.ce_at(curve, 30.0) == pytest.approx(4.5)  # halfway from 20 s to 40 s
    assert B.ce_at(curve, 40.0) == 4.0 and B.ce_at(curve, 5.0) == 5.0  # before the first checkpoint: its CE
    assert B.ce_at(curve, 90.0) == 3.5  # past the end: the last CE, no credit for steps not taken


def test_split_gives_minimind_whole_epochs_of_whole_batches():
    docs = [f"doc {i}" for i in range(1000)]
    s = B.split_corpus(docs, steps=166, batch_size=8, held_out=200, seed=42)
    assert s.epochs == 2 and len(s.train) == 8 * 83 and s.steps == 166 and len(s.held_out) == 200
    assert not set(s.train) & set(s.held_out)
    assert B.split_corpus(docs, 166, 8, 200, 42).train == s.train  # seeded
    assert B.real_tokens_minimind([[5] * 3, [6] * 500], epochs=2, row_len=257) == 2 * ((3 + 1) + (255 + 1))

