"""Evaluation off the training path (minilm.evaluate, ray_jobs.evaluate): multiple-choice scores against a plain
log_softmax written here, a trained tiny model above chance, bits per byte as minilm.bpb scores it, one line for
each malformed item, and the CLI on a checkpoint and a run folder. No Ray: everything runs in this process."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import save_resume_state

from minilm import checkpoint as C
from minilm.bpb import evaluate_documents, token_byte_lengths
from minilm.config import ModelConfig, TrainConfig
from minilm.evaluate import choice_loglikelihoods, choice_metrics, evaluate_checkpoint, fewshot_prefix
from minilm.model import MiniMindForCausalLM
from minilm.step import make_grad_scaler, make_optimizer
from minilm.tasks import ChoiceItem, TaskError, load_tasks, read_choice, read_hellaswag
from minilm.tokenizer import BOS_ID, save_tokenizer, train_tokenizer
from ray_jobs import evaluate as cli

# Facts a tiny model can learn in a few steps: each animal has its one place.
ANIMALS = ["cat", "dog", "fox", "owl", "bee", "cow", "pig", "hen"]
PLACES = ["on the mat", "in the barn", "under the tree", "near the river"]
FACTS = [(a, PLACES[(i * 3) % 4]) for i, a in enumerate(ANIMALS)]
SENTENCES = [f"the {a} sleeps {p}." for a, p in FACTS]
RESUME_POSITION = {"world_size": 1, "accumulation_steps": 1, "global_batch_size": 8, "data_fingerprint": "0" * 64,
                   "nonfinite_guard": {"skipped_total": 0, "in_a_row": 0, "first_step_in_a_row": 0}}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = train_tokenizer(SENTENCES * 4 + ["The quick brown fox jumps over the lazy dog, again and again."], 300)
    return tok, save_tokenizer(tok, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def tiny_model(seed: int = 0) -> MiniMindForCausalLM:
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128)
    return MiniMindForCausalLM(cfg).eval()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def facts_hellaswag(path):
    return write_jsonl(path, [{"ctx": f"the {a} sleeps", "endings": [p + "." for p in PLACES],
                               "label": PLACES.index(p)} for a, p in FACTS])


def reference_loglik(model, tok, context: str | list[int], choice: str) -> float:
    """log P(choice | [BOS] + context): a full forward, log_softmax over every position, the choice's summed."""
    ctx = tok.encode(context).ids if isinstance(context, str) else context
    cont = tok.encode(choice).ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[BOS_ID, *ctx, *cont]])).logits[0].double(), dim=-1)
    return sum(float(logp[len(ctx) + k, t]) for k, t in enumerate(cont))  # position p predicts token p + 1


# ---- (a) scores against an independent computation ------------------------------------------------

def test_choice_loglikelihoods_and_accuracies_match_a_plain_log_softmax(tokenizer, tmp_path):
    tok, _ = tokenizer
    model = tiny_model(seed=1)
    rows = [{"ctx": "the quick brown fox", "endings": ["jumps", "jumps over the lazy dog again", "x", "sleeps"],
             "label": 1},
            {"ctx": "again and", "endings": ["again", "the cat sleeps on the mat.", "dog"], "label": 0},
            {"ctx": "the owl", "endings": ["sleeps near the river.", "in", "the barn under the tree"], "label": 2}]
    items = read_hellaswag(write_jsonl(tmp_path / "hs.jsonl", rows))
    for prefix in ("", fewshot_prefix(items[:1])):
        got = choice_loglikelihoods(model, tok, items, prefix=prefix, batch_size=4)  # batches cut across items
        want = [[reference_loglik(model, tok, prefix + it.context, c) for c in it.choices] for it in items]
        for g, w in zip(got, want, strict=True):
            assert g == pytest.approx(w, abs=1e-4)
        acc = acc_norm = 0
        for w, it in zip(want, items, strict=True):
            per_byte = [v / len(c.encode()) for v, c in zip(w, it.choices, strict=True)]
            acc += int(torch.tensor(w).argmax()) == it.label
            acc_norm += int(torch.tensor(per_byte).argmax()) == it.label
        assert choice_metrics(items, got) == {"acc": pytest.approx(acc / 3), "acc_norm": pytest.approx(acc_norm / 3)}
    # acc and acc_norm are different rules: a long choice loses on its sum but may win per byte
    items = [ChoiceItem("c", (" a", " abcdefgh"), 1)]
    assert choice_metrics(items, [[-2.0, -8.0]]) == {"acc": 0.0, "acc_norm": 1.0}


def test_a_long_context_is_cut_from_the_left_and_the_choice_kept_whole(tokenizer):
    tok, _ = tokenizer
    model = tiny_model(seed=2)
    item = ChoiceItem(" ".join(SENTENCES), (" on the mat.", " in the barn."), 0)
    got = choice_loglikelihoods(model, tok, [item], max_len=20)
    cont = [tok.encode(c).ids for c in item.choices]
    for value, c, ids in zip(got[0], item.choices, cont, strict=True):
        ctx = tok.encode(item.context).ids[-(20 - 1 - len(ids)):]
        assert value == pytest.approx(reference_loglik(model, tok, ctx, c), abs=1e-4)


# ---- (b) a trained model is above chance --------------------------------------------------------------

def train(model, tok, steps: int = 30):
    """A handful of AdamW steps on the sentences, as one batch of [BOS] + sentence."""
    rows = [[BOS_ID, *tok.encode(s).ids] for s in SENTENCES]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = labels[i, :len(r)] = torch.tensor(r)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small gain nothing from a second thread, and lose on a busy machine
    try:
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            model(ids, labels=labels).loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


def test_a_model_trained_on_the_facts_scores_above_chance(tokenizer, tmp_path):
    tok, _ = tokenizer
    items = read_hellaswag(facts_hellaswag(tmp_path / "facts.jsonl"))
    untrained = choice_metrics(items, choice_loglikelihoods(tiny_model(), tok, items))
    trained = choice_metrics(items, choice_loglikelihoods(train(tiny_model(), tok), tok, items))
    assert trained["acc"] >= 0.75 and trained["acc_norm"] >= 0.75, (trained, untrained)
    assert trained["acc"] > 0.25 + 0.25  # chance is 1 in 4


# ---- (c) bits per byte is minilm.bpb's ----------------------------------------------------------------

def test_bpb_task_equals_evaluate_documents_and_generations_are_greedy(tokenizer, tmp_path):
    tok, tok_path = tokenizer
    model = tiny_model(seed=3)
    export = C.write_weights_export(tmp_path / "weights", C.model_tensors(model.state_dict()), model.config,
                                    tok_path, dtype=torch.float32)
    docs = ["the cat sleeps on the mat. " * 5, "The quick brown fox jumps over the lazy dog.", SENTENCES[3]]
    write_jsonl(tmp_path / "held.jsonl", [{"text": d} for d in docs])
    (tmp_path / "prompts.txt").write_text("the fox\n\nthe cow sleeps\n")
    (tmp_path / "tasks.yaml").write_text("tasks:\n"
                                         "  - {name: held, kind: bpb, path: held.jsonl, window: 24, stride: 10}\n"
                                         "  - {name: gen, kind: generate, path: prompts.txt, max_new_tokens: 6}\n")
    bpb, gen = evaluate_checkpoint(export, load_tasks(tmp_path / "tasks.yaml"))
    want = evaluate_documents(model, [tok.encode(d).ids for d in docs], token_byte_lengths(tok_path),
                              prefix=[BOS_ID], window=24, stride=10)
    assert bpb["metrics"]["bpb"] == pytest.approx(want["bpb"], rel=1e-6) and bpb["tokens"] == want["tokens"]
    assert bpb["step"] is None and bpb["file_sha256"] == C.file_sha256(tmp_path / "held.jsonl")
    assert [g["prompt"] for g in gen["generations"]] == ["the fox", "the cow sleeps"]
    ids = [BOS_ID, *tok.encode("the fox").ids]
    out = model.generate(torch.tensor([ids]), max_new_tokens=6, temperature=0, eos_token_id=2)[0, len(ids):]
    assert gen["generations"][0]["text"] == tok.decode(out.tolist())


# ---- (d) a malformed item is one line naming its file and line ---------------------------------------

MALFORMED = [
    ("hellaswag", "hs.jsonl", '{"ctx": "a", "endings": ["b", "c"], "label": 0}\n{"ctx": "a", "endings": ["b"\n',
     2, "not valid JSON"),
    ("hellaswag", "hs.jsonl", '\n{"endings": ["b", "c"], "label": 0}\n', 2, "'ctx' must be a non-empty string"),
    ("hellaswag", "hs.jsonl", '{"ctx": "a", "endings": ["b", "c"], "label": 2}\n', 1, "'label' must be an index"),
    ("hellaswag", "hs.jsonl", '{"ctx": "a", "endings": "b", "label": 0}\n', 1, "'endings' must be a list"),
    ("choice", "mmlu.csv", 'q1,a,b,c,d,A\n"q2\nspans lines",a,b,c,d,E\n', 2, "answer must be one of A, B, C, D"),
    ("choice", "mmlu.csv", 'q1,a,b,c,d,A\nq2,a,b,c,B\n', 2, "expected question, A, B, C, D, answer columns"),
    ("choice", "mmlu.csv", 'q1,a,b,c,d,AB\n', 1, "answer must be one of A, B, C, D"),
    ("choice", "mmlu.csv", 'q1,a,b,c,d,A\nq2,a,b,c,d,b\n', 2, "answer must be one of A, B, C, D"),
    ("choice", "ceval.csv", 'id,question,A,B,C,D,answer,explanation\n0,q,a,b,c,d,,\n', 2, "test split has no"),
    ("choice", "ceval.csv", 'id,question,A,B,C,D\n0,q,a,b,c,d\n', 1, "the header has no answer column"),
    ("choice", "q.jsonl", '{"question": "q", "choices": ["a", "b", "c"], "answer": "A"}\n', 1, "needs 4"),
    ("choice", "q.jsonl", '{"question": "q", "A": "a", "B": "b", "C": "c", "D": "d", "answer": 1}\n', 1,
     "answer must be one of A, B, C, D"),
    ("bpb", "held.jsonl", '{"text": "ok"}\n{"txt": "no"}\n', 2, "'text' must be a non-empty string"),
    ("generate", "p.jsonl", '[1, 2]\n', 1, "expected a JSON object"),
]


@pytest.mark.parametrize("kind, name, content, line, what", MALFORMED, ids=[f"{c[0]}-{c[4][:20]}" for c in MALFORMED])
def test_a_malformed_item_is_one_line_naming_file_and_line(tmp_path, capsys, kind, name, content, line, what):
    (tmp_path / name).write_text(content)
    (tmp_path / "tasks.yaml").write_text(f"tasks:\n  - {{name: t, kind: {kind}, path: {name}}}\n")
    with pytest.raises(TaskError) as e:
        load_tasks(tmp_path / "tasks.yaml")
    message = str(e.value)
    assert message.startswith(f"{tmp_path / name}:{line}: ") and what in message and "\n" not in message, message
    code = cli.main(["--checkpoint", str(tmp_path), "--tasks", str(tmp_path / "tasks.yaml"),
                     "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: {message}\n"


TASK_LIST_ERRORS = [
    ("- {name: t, kind: mystery, path: hs.jsonl}", "'kind' must be one of hellaswag, choice, bpb, generate"),
    ("- {name: t, kind: hellaswag, path: hs.jsonl, shots: 2}", "unknown option 'shots' for kind hellaswag"),
    ("- {name: t, kind: hellaswag, path: hs.jsonl, fewshot: 3}", "fewshot 3 needs 3 examples, the file has 2"),
    ("- {name: t, kind: hellaswag, path: hs.jsonl, fewshot: 2}", "has no items to score"),
    ("- {name: t, kind: hellaswag, path: hs.jsonl, limit: 0}", "limit must be an integer >= 1"),
    ("- {name: t, kind: bpb, path: hs.jsonl, window: 1}", "window must be an integer >= 2"),
    ("- {name: t, kind: hellaswag, path: nothere.jsonl}", "nothere.jsonl does not exist"),
    ("- {name: t, kind: hellaswag, path: hs.jsonl}\n- {name: t, kind: hellaswag, path: hs.jsonl}", "'t' repeats"),
    ("[unclosed", "not valid YAML or JSON"),
    # trusted by type only: a list for a kind, a name that is no single path part (it keys eval/<name>/<metric>),
    # a path option that is no string (an alias bomb there would expand without end)
    ("- {name: t, kind: [bpb], path: hs.jsonl}", "'kind' must be one of"),
    ("- {name: a/b, kind: bpb, path: hs.jsonl}", "'name' 'a/b' is not a safe name"),
    ("- {name: t, kind: choice, path: hs.jsonl, fewshot: 1, fewshot_path: [1, 2]}", "fewshot_path must name a file"),
    ("a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]\n" for p, c in
                                                   zip("abcdefgh", "bcdefghi", strict=True)) +
     "tasks:\n  - {name: t, kind: choice, path: hs.jsonl, fewshot: 1, fewshot_path: *i}",
     "fewshot_path must name a file, got a list"),
]


@pytest.mark.parametrize("listing, what", TASK_LIST_ERRORS, ids=[w[:24] for _, w in TASK_LIST_ERRORS])
def test_a_bad_task_list_is_one_line(tmp_path, listing, what):
    write_jsonl(tmp_path / "hs.jsonl", [{"ctx": "a", "endings": ["b", "c"], "label": 0}] * 2)
    (tmp_path / "tasks.yaml").write_text(listing + "\n")
    with pytest.raises(TaskError, match="^task list ") as e:
        load_tasks(tmp_path / "tasks.yaml")
    assert what in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_jsonl_strings_may_hold_line_separators(tmp_path):
    row = json.dumps({"ctx": "a\u2028b", "endings": ["c\x1cd", "e"], "label": 1}, ensure_ascii=False)
    path = tmp_path / "hs.jsonl"
    path.write_text(f"{row}\n{row}\n", encoding="utf-8")  # raw U+2028, as a writer without ensure_ascii leaves it
    assert "\u2028" in path.read_text(encoding="utf-8")
    assert read_hellaswag(path) == [ChoiceItem("a\u2028b", (" c\x1cd", " e"), 1)] * 2


def test_the_csv_layouts_of_mmlu_ceval_and_cmmlu_read_alike(tmp_path):
    (tmp_path / "mmlu.csv").write_text('What is 2+2?,3,4,5,6,B\n')
    (tmp_path / "ceval.csv").write_text('id,question,A,B,C,D,answer,explanation\n0,What is 2+2?,3,4,5,6,B,easy\n')
    (tmp_path / "cmmlu.csv").write_text(',Question,A,B,C,D,Answer\n0,What is 2+2?,3,4,5,6,B\n')
    want = [ChoiceItem("Question: What is 2+2?\nAnswer:", (" 3", " 4", " 5", " 6"), 1)]
    for name in ("mmlu.csv", "ceval.csv", "cmmlu.csv"):
        assert read_choice(tmp_path / name) == want


# ---- (e) the CLI ---------------------------------------------------------------------------------------

def write_checkpoint(path, model, tok_path, step: int):
    tcfg = TrainConfig(seq_len=32, micro_batch_size=8, global_batch_size=8, max_steps=10, warmup_steps=1)
    state = {"optimizer_step": step, "model_config": model.config.to_dict(), "train_config": tcfg.to_dict(),
             "tokenizer_sha256": C.file_sha256(tok_path), **RESUME_POSITION}
    return save_resume_state(path, model=model, optimizer=make_optimizer(model, tcfg),
                             scaler=make_grad_scaler(torch.float32, "cpu"), state=state)


@pytest.fixture
def task_list(tmp_path):
    facts_hellaswag(tmp_path / "facts.jsonl")
    (tmp_path / "mmlu.csv").write_text("".join(f"Where does the {a} sleep?,{','.join(PLACES)},"
                                               f"{'ABCD'[PLACES.index(p)]}\n" for a, p in FACTS))
    write_jsonl(tmp_path / "held.jsonl", [{"text": s} for s in SENTENCES[:3]])
    (tmp_path / "tasks.yaml").write_text(
        "tasks:\n"
        "  - {name: facts, kind: hellaswag, path: facts.jsonl, fewshot: 2}\n"
        "  - {name: where, kind: choice, path: mmlu.csv}\n"
        "  - {name: held, kind: bpb, path: held.jsonl}\n")
    return tmp_path / "tasks.yaml"


def test_cli_on_a_checkpoint_appends_records_once(tokenizer, tmp_path, task_list, capsys):
    tok, tok_path = tokenizer
    ckpt = write_checkpoint(tmp_path / "run" / "checkpoint_00000007", train(tiny_model(), tok), tok_path, 7)
    out = tmp_path / "results.jsonl"
    argv = ["--checkpoint", str(ckpt), "--tasks", str(task_list), "--output", str(out), "--tokenizer", str(tok_path)]
    assert cli.main(argv) == 0
    console = capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["task"] for r in records] == ["facts", "where", "held"]
    assert {r["step"] for r in records} == {7} and {r["checkpoint"] for r in records} == {str(ckpt)}
    assert records[0]["items"] == len(FACTS) - 2  # the few-shot examples are not scored
    assert records[0]["file_sha256"] == C.file_sha256(tmp_path / "facts.jsonl")
    assert set(records[0]["metrics"]) == {"acc", "acc_norm"} and set(records[2]["metrics"]) >= {"bpb"}
    assert "step" in console.splitlines()[0] and "facts" in console and "acc_norm" in console and "bpb" in console
    before = out.read_text()
    assert cli.main(argv) == 0  # a rerun evaluates nothing again
    assert out.read_text() == before and "already" in capsys.readouterr().out
    # Another tokenizer than the one the checkpoint's data was prepared with is refused
    other = save_tokenizer(train_tokenizer(["something else entirely"] * 3, 280), tmp_path / "other.json")
    assert cli.main([*argv[:-1], str(other), "--output", str(tmp_path / "o2.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not the tokenizer this checkpoint" in err and err.count("\n") == 1


def test_cli_on_a_run_folder_skips_torn_and_corrupt_checkpoints(tokenizer, tmp_path, task_list, capsys):
    tok, tok_path = tokenizer
    run = tmp_path / "run"
    model = tiny_model()
    write_checkpoint(run / "checkpoint_00000002", model, tok_path, 2)  # no weights/: the run's tokenizer is found
    write_checkpoint(run / "checkpoint_00000004", train(model, tok, 2), tok_path, 4)
    C.write_weights_export(run / "checkpoint_00000004" / "weights", C.model_tensors(model.state_dict()), model.config,
                           tok_path, in_place=True)
    torn = write_checkpoint(run / "checkpoint_00000006", model, tok_path, 6)
    (torn / C.MARKER).unlink()  # a write that did not finish
    out = tmp_path / "results.jsonl"
    argv = ["--run-dir", str(run), "--tasks", str(task_list), "--output", str(out)]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("skipping checkpoint") == 1 and "checkpoint_00000006 is incomplete" in err, err
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()] == [2, 2, 2, 4, 4, 4]
    # training wrote two more, one of them corrupt: a rerun scores only the sound new one
    write_checkpoint(run / "checkpoint_00000008", model, tok_path, 8)
    corrupt = write_checkpoint(run / "checkpoint_00000010", model, tok_path, 10)
    weights = corrupt / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\0\0\0\0")
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "checkpoint_00000010 is corrupt" in err and "checkpoint_00000006" in err, err
    assert [json.loads(line)["step"] for line in out.read_text().splitlines()][6:] == [8, 8, 8]
    # the corrupt one named on the command line: one line, exit 2
    code = cli.main(["--checkpoint", str(corrupt), *argv[2:]])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: checkpoint {corrupt} is corrupt") and err.count("\n") == 1, err
