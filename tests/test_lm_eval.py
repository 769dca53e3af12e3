"""lm-evaluation-harness on minilm's HF export (`lm_eval --model hf`, docs/evaluation.md), offline, on a local task
(a task YAML over a JSONL file): each choice's log-likelihood is minilm's own, and so `acc` is ray_jobs.evaluate's;
`acc_norm` is the harness's definition (per character of the choice, not per UTF-8 byte of " " + choice)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_hf_export import make_checkpoint

from minilm.evaluate import choice_loglikelihoods
from minilm.tasks import read_hellaswag
from minilm.tokenizer import load_tokenizer
from ray_jobs import evaluate, export

pytest.importorskip("lm_eval", reason="pip install 'minilm[eval]'")
pytest.importorskip("accelerate", reason="pip install 'minilm[eval]' (lm-eval's hf model needs accelerate)")

ITEMS = [
    {"ctx": "The quick brown fox", "endings": ["jumps over the lazy dog.", "reads", "is sorted by key", "returns"],
     "label": 0},
    {"ctx": "def read(path):", "endings": ["return open(path).read()", "the fox", "sorted by key.", "dog"], "label": 0},
    {"ctx": "Return the list of items,", "endings": ["sorted by key.", "jumps", "over the lazy dog", "open(path)"],
     "label": 0},
    {"ctx": "The lazy dog", "endings": ["sleeps", "is sorted", "returns open(path).read()", "jumps over the fox"],
     "label": 3},
    {"ctx": "Return the", "endings": ["list", "quick brown fox jumps.", "path", "lazy dog"], "label": 1},
    {"ctx": "The quick brown", "endings": ["fox", "dog", "list", "key"], "label": 0},
]
TASK_YAML = """\
task: minilm_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{ctx}}}}"
doc_to_choice: "{{{{endings}}}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
"""


@pytest.mark.slow
def test_lm_eval_on_the_hf_export_scores_as_ray_jobs_evaluate(tmp_path):
    ckpt, model = make_checkpoint(tmp_path)
    assert export.main(["--checkpoint", str(ckpt), "--output", str(tmp_path / "hf"), "--format", "hf",
                        "--dtype", "fp32"]) == 0
    items = tmp_path / "items.jsonl"
    items.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "minilm_local.yaml").write_text(TASK_YAML.format(items=items))
    (tmp_path / "tasks.yaml").write_text(f"tasks:\n  - {{name: local, kind: hellaswag, path: {items}}}\n")

    assert evaluate.main(["--checkpoint", str(ckpt), "--tasks", str(tmp_path / "tasks.yaml"),
                          "--output", str(tmp_path / "eval.jsonl"), "--device", "cpu"]) == 0
    ours = json.loads((tmp_path / "eval.jsonl").read_text())["metrics"]

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(  # the command docs/evaluation.md gives
        [sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
         f"pretrained={tmp_path / 'hf'},add_bos_token=True,dtype=float32", "--include_path", str(tmp_path / "tasks"),
         "--tasks", "minilm_local", "--device", "cpu", "--batch_size", "8", "--log_samples",
         "--output_path", str(tmp_path / "lm-eval")], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout)
    results = json.loads(next((tmp_path / "lm-eval").rglob("results_*.json")).read_text())["results"]["minilm_local"]
    samples = [json.loads(line) for line in next((tmp_path / "lm-eval").rglob("samples_minilm_local_*.jsonl")).open()]

    loglik = choice_loglikelihoods(model, load_tokenizer(ckpt / "weights" / "tokenizer.json"), read_hellaswag(items))
    for sample in samples:  # [BOS] + context + " " + ending: the same tokens, the same sums
        assert [float(r[0][0]) for r in sample["resps"]] == pytest.approx(loglik[sample["doc_id"]], abs=1e-4)
    assert results["acc,none"] == ours["acc"]
    by_chars = [max(range(4), key=lambda j: ll[j] / len(item["endings"][j])) == item["label"]  # noqa: B023
                for item, ll in zip(ITEMS, loglik, strict=True)]
    assert results["acc_norm,none"] == pytest.approx(sum(by_chars) / len(ITEMS))
    print(f"lm-eval acc {results['acc,none']:.4f} acc_norm {results['acc_norm,none']:.4f}; "
          f"ray_jobs.evaluate acc {ours['acc']:.4f} acc_norm {ours['acc_norm']:.4f}")
