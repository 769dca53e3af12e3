"""Wrong invocations of every command (pretrain, prepare, tune, export, train, sample, evaluate, plot): bad values,
bad data, missing files, crafted checkpoints and run folders. Each is one clear `error:` line, exit 2, nothing written.

Table-driven; each case runs the command's `main()` in this process (the session's Ray is shared
for the few cases that need to look at data on a running cluster).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from fixtures.make_checkpoint_fixture import train_args
from helpers import make_prepared, matches, save_resume_state, tree, write_marker
from test_best_checkpoint import marked, update
from test_checkpoint_compat import CHECKPOINT, FORMATS, edit_state, resumable_copy
from test_plot import write_run
from test_train_single import SMALL_FLAGS

from minilm import checkpoint as C
from minilm import sample
from minilm import train as train_cli
from minilm.config import ModelConfig
from minilm.model import MiniMindForCausalLM
from ray_jobs import evaluate, export, plot, prepare, pretrain, tune

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_prepared(tmp_path_factory.mktemp("bad") / "data", num_sequences=64, seq_len=32, vocab_size=256)


def setup_files(tmp: Path) -> dict[str, str]:
    (tmp / "list.yaml").write_text("- 1\n- 2\n")
    (tmp / "unknown.yaml").write_text("hidden_size: 64\nnot_a_field: 3\n")
    (tmp / "broken.yaml").write_text("lr: [1, 2\n")
    (tmp / "nomanifest").mkdir()
    (tmp / "doc.jsonl").write_text('{"text": "hello"}\n{"text": "hello"\n')
    (tmp / "c.jsonl").write_text('{"text": "hello"}\n{"text": "a second line"}\n')
    (tmp / "held.jsonl").write_text(json.dumps({"text": "the cat"}) + "\n")
    (tmp / "tasks.yaml").write_text("tasks:\n  - {name: held, kind: bpb, path: held.jsonl}\n")
    (tmp / "null-resume.yaml").write_text("resume: ~\n")
    (tmp / "sweep.yaml").write_text('num_samples: "4"\nsearch:\n  lr: choice:1e-3,2e-3\n')
    (tmp / "sweep-scheduler.yaml").write_text("scheduler: hyperband\nsearch:\n  lr: choice:1e-3,2e-3\n")
    return {"tmp": str(tmp)}


# The inputs of the cases that need more than setup_files: each writes into the case's folder.

def named(name: str, write):
    write.__name__ = name  # in the case's id
    return write


def weights_folder(name: str, config_of):
    """An exported weights folder whose config.json is config_of(the model's config), its marker re-written to
    match (consistent, as a hand-made folder is)."""
    def write(tmp: Path) -> None:
        cfg = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2)
        weights = C.export_weights(tmp / name, MiniMindForCausalLM(cfg), cfg)
        (weights / "config.json").write_text(json.dumps(config_of(cfg.to_dict())))
        write_marker(weights, ["model.safetensors", "config.json"])
    return named(name, write)


def edited_state(name: str, edit):
    """The newest fixture checkpoint in {tmp}/run (its tokens in {tmp}/tokens.npy), state.json edited and re-hashed."""
    return named(name, lambda tmp: edit_state(resumable_copy(FORMATS[-1], tmp)[0] / CHECKPOINT, edit))


def best_json(case: str):
    """{tmp}/run1 with a marked checkpoint 4, and best.json in the state `case` names."""
    def write(tmp: Path) -> None:
        run = tmp / "run1"
        marked(run, 4)
        folder = C.RunFolder(run)
        if case == "gone":  # e.g. moved aside by --abandon-newer
            update(folder, "held/bpb", 6, 1.0)
        elif case == "replaced":  # its step written again after --abandon-newer
            update(folder, "held/bpb", 4, 1.0, sha="b" * 64)
        elif case == "damaged":
            (run / C.BEST).write_text("{")
    return named(f"best-{case.replace(' ', '-')}", write)


TINY = ["--seq-len", "32", "--vocab-size", "256", "--hidden-size", "64", "--num-hidden-layers", "2",
        "--num-attention-heads", "4", "--num-key-value-heads", "2", "--micro-batch-size", "4",
        "--global-batch-size", "16", "--max-steps", "4", "--warmup-steps", "1"]

# (command, argv with {data} and {tmp} placeholders, what the one error line must say)
CASES = [
    ("pretrain", ["--lr", "-1"], "lr must be a positive number"),
    ("pretrain", ["--warmup-steps", "150"], "warmup_steps (150) must be smaller than the total optimizer steps (100)"),
    ("pretrain", ["--num-workers", "33"], "valid world sizes: 1-32"),  # every worker needs a sequence
    ("pretrain", ["--num-workers", "0"], "need 1 <= MIN <= MAX"),
    ("pretrain", ["--num-workers", "4-2"], "need 1 <= MIN <= MAX"),
    ("pretrain", ["--num-workers", "two"], "expected N or MIN-MAX"),
    ("pretrain", ["--num-workers", "30-33"], "world size(s) 33 cannot keep global_batch_size 32"),
    ("pretrain", ["--hidden-size", "100"], "num_attention_heads (8) must divide hidden_size (100)"),
    ("pretrain", ["--num-key-value-heads", "3"], "num_key_value_heads (3) must divide num_attention_heads (8)"),
    ("pretrain", ["--min-lr-ratio", "2"], "min_lr_ratio must be in [0, 1]"),
    ("pretrain", ["--betas", "0.9", "1.5"], "betas must be two numbers in [0, 1)"),
    ("pretrain", ["--max-steps", "0"], "max_steps must be an integer >= 1"),
    ("pretrain", ["--seq-len", "40000"], "exceeds max_position_embeddings"),
    ("pretrain", ["--keep-checkpoints", "0"], "--keep-checkpoints must be an integer >= 1"),
    ("pretrain", ["--exit-after-minutes", "0"], "--exit-after-minutes must be > 0"),
    ("pretrain", ["--eval-every", "0"], "eval_every must be an integer >= 1, got 0"),
    ("pretrain", ["--collective-timeout-s", "0.5"], "--collective-timeout-s must be >= 1, got 0.5"),
    ("pretrain", ["--rms-norm-eps", "inf"], "rms_norm_eps must be a finite number, got inf"),
    ("pretrain", ["--weight-decay", "inf"], "weight_decay must be a finite number, got inf"),
    ("pretrain", ["--resources-per-worker", "slot"], "expected NAME=N with N > 0"),
    ("pretrain", ["--cpus-per-worker", "many"], "--cpus-per-worker must be auto or a number > 0, got 'many'"),
    ("pretrain", ["--cpus-per-worker", "0"], "--cpus-per-worker must be auto or a number > 0"),
    ("pretrain", ["--data", "{data}", *TINY[:-2], "--warmup-steps", "4"],
     "warmup_steps (4) must be smaller than the total optimizer steps (4)"),
    ("pretrain", ["--resources-per-worker", "CPU=2"], "CPU and GPU have their own flags"),
    ("pretrain", ["--tracker", "neptune"], "--tracker neptune: unknown tracker"),
    ("pretrain", ["--tracker", "none,mlflow"], "--tracker none cannot be combined"),
    ("pretrain", ["--config", "{tmp}/missing.yaml"], "file not found"),
    ("pretrain", ["--config", "{tmp}/list.yaml"], "expected a mapping"),
    ("pretrain", ["--config", "{tmp}/broken.yaml"], "not valid YAML"),
    ("pretrain", ["--config", "{tmp}/unknown.yaml"], "unknown option(s) not_a_field"),
    ("pretrain", ["--resume", "{tmp}/no-such-checkpoint"], "does not exist"),
    ("pretrain", ["--resume", "9" * 400], "cannot be read (File name too long)"),
    ("pretrain", ["--data", "{tmp}/missing-data"], "does not exist (make one with `python -m ray_jobs.prepare`)"),
    ("pretrain", ["--data", "{tmp}/nomanifest"], "has no manifest.json"),
    ("pretrain", ["--data", "{data}", *TINY[:-4], "--seq-len", "64"], "packed with seq_len 32"),
    ("pretrain", ["--data", "{data}", *TINY, "--vocab-size", "128"], "its tokenizer has 256 tokens"),
    ("pretrain", ["--data", "{data}", *TINY, "--val-samples", "64"], "val_samples 64 must be in [0, 64)"),
    ("pretrain", ["--data", "{data}", *TINY, "--global-batch-size", "128", "--micro-batch-size", "8"],
     "do not fill one global batch of 128"),
    ("pretrain", ["--data", "{data}", *TINY, "--dtype", "fp16", "--use-gpu", "false"], "--dtype fp16 needs GPU"),
    ("pretrain", ["--eval-tasks", "{tmp}/no-tasks.yaml"], "--eval-tasks: "),
    ("pretrain", ["--eval-resources", "CPU=0"], "--eval-resources 'CPU=0': expected NAME=N with N > 0"),
    ("pretrain", ["--eval-wait-minutes", "0"], "--eval-wait-minutes must be > 0"),
    ("prepare", ["--input", "{tmp}/missing.jsonl", "--output", "{tmp}/out"], "missing.jsonl"),
    ("prepare", ["--input", "{tmp}/doc.jsonl", "--output", "{tmp}/out2", "--seq-len", "0"],
     "--seq-len must be at least 1"),
    ("prepare", ["--output", "x"], "the following arguments are required: --input"),
    *[("prepare", ["--input", "{tmp}/c.jsonl", "--output", "{tmp}/out", *flags], needle) for flags, needle in [
        (["--seq-len", "0"], "--seq-len must be at least 1"), (["--vocab-size", "2"], "--vocab-size 2 is too small"),
        (["--vocab-size", "100"], "needs at least 259"), (["--num-cpus", "0"], "--num-cpus must be at least 1"),
        (["--rows-per-shard", "0"], "--rows-per-shard must be at least 1"), (["--seq-len", "abc"], "invalid int value"),
        (["--vocab-size", "300", "--tokenizer", "t.json"], "not allowed with argument"),
        (["--on-bad-record", "ignore"], "invalid choice")]],
    ("prepare", ["--input", "{tmp}/doc.jsonl", "--output", "{tmp}/out3", "--vocab-size", "4", "--seq-len", "8"],
     "vocab"),
    ("export", ["--checkpoint", "{tmp}/no-ckpt", "--output", "{tmp}/exp"], "does not exist"),
    ("tune", ["--search", "lr=uniform:3e-3:1e-4"], "low 0.003 must be < high 0.0001"),
    ("tune", ["--search", "depth=choice:1,2"], "unknown parameter 'depth'"),
    ("tune", ["--search", "lr=loguniform"], "cannot parse"),
    ("tune", [], "nothing to search"),
    # refused before any trial starts (the session's Ray has 8 CPUs)
    ("tune", ["--data", "{data}", *TINY, "--search", "lr=choice:1e-3", "--max-concurrent-trials", "50",
              "--workers-per-trial", "2"], "error: --max-concurrent-trials 50 x (--workers-per-trial 2 x "
     "--cpus-per-worker …) = … CPUs, but the cluster has 8; at most … concurrent trial(s) fit"),
    ("tune", ["--data", "{data}", *TINY, "--search", "warmup_steps=choice:1,4"],
     "error: --search warmup_steps: value 4 gives an invalid run: invalid configuration:\n"
     "  - warmup_steps (4) must be smaller than the total optimizer steps (4)"),
    ("tune", ["--config", "{tmp}/sweep.yaml"], "error: --num-samples, --max-concurrent-trials, --workers-per-trial, "
     "--grace-steps: whole numbers, got '4', 1, 1, 1"),
    ("tune", ["--config", "{tmp}/sweep-scheduler.yaml"], "error: --scheduler must be one of asha, none, got 'hyperband'"),
    *[("tune", ["--search", "lr=choice:1e-3", flag, "0"], f"error: {flag} must be >= 1, got 0")  # not the default
      for flag in ("--num-samples", "--grace-steps")],
    # From here: a message opening with "error: " is the whole of stderr (one ending in "…": its first line)
    ("train", ["--random-tokens", "2000", "--keep-checkpoints", "0"],
     "error: --keep-checkpoints must be an integer >= 1, got 0"),
    ("train", ["--random-tokens", "2000", "--collective-timeout-s", "0"],
     "error: --collective-timeout-s must be >= 1, got 0.0"),
    ("train", ["--config", "{tmp}/null-resume.yaml", "--random-tokens", "2000", "--max-steps", "1"],
     "error: --resume needs a value, got null (leave it out for the default, auto)"),  # PyYAML's None, as fuzzing found
    *[("train", ["--random-tokens", "2000", "--max-steps", "2", *SMALL_FLAGS, *args],  # the last flag wins
       f"error: invalid configuration:\n  - {message}") for args, message in [
        (["--lr", "-1"], "lr must be a positive number, got -1.0"),
        (["--global-batch-size", "0", "--micro-batch-size", "4"], "global_batch_size must be an integer >= 1, got 0"),
        (["--betas", "0.9", "1.5"], "betas must be two numbers in [0, 1), got (0.9, 1.5)"),
        (["--hidden-size", "60"], "num_attention_heads (8) must divide hidden_size (60)"),
        (["--warmup-steps", "2"], "warmup_steps (2) must be smaller than the total optimizer steps (2)")]],
    ("train", ["--tokens", "{tmp}/ids-300.npy", "--vocab-size", "256", "--seq-len", "16", "--max-steps", "1"],
     "error: --tokens {tmp}/ids-300.npy: token id 300 is outside the vocabulary [0, 256)",
     named("ids-300", lambda tmp: np.save(tmp / "ids-300.npy", np.array([1, 2, 300, 4] * 100, dtype=np.int64)))),
    ("train", ["--tokens", "{tmp}/ids-2d.npy", "--vocab-size", "256", "--seq-len", "16", "--max-steps", "1"],
     "error: --tokens {tmp}/ids-2d.npy: expected a .npy file of a 1-D array of integer token ids",
     named("ids-2d", lambda tmp: np.save(tmp / "ids-2d.npy", np.zeros((4, 4))))),
    # 0.9e12 parameters: under the config's bound of 1e13, past any allocation here (the first, q_proj's, is 275 GB)
    ("train", ["--random-tokens", "5000", "--seq-len", "32", "--hidden-size", "262144", "--num-hidden-layers", "1",
               "--vocab-size", "256", "--max-steps", "1"], "error: the run does not fit in this machine's memory: …"),
    *[("train", [*train_args(Path("{tmp}/tokens.npy"), Path("{tmp}/other" if resume else "{tmp}/run")), *resume],
       f"error: checkpoint {{tmp}}/run/{CHECKPOINT}…{message}…", edited_state(name + "-resume-path" * bool(resume), edit))
      for resume in ([], ["--resume", f"{{tmp}}/run/{CHECKPOINT}"]) for name, edit, message in [
        ("lacks-a-key", lambda s: s.pop("nonfinite_guard"), "state.json lacks nonfinite_guard (format 1)"),
        ("lacks-the-seed", lambda s: s["train_config"].pop("seed"), "state.json lacks train_config.seed"),
        ("future-format", lambda s: s.update(format_version=C.STATE_FORMAT + 1),
         f"has state.json format {C.STATE_FORMAT + 1}, and this version of minilm reads formats 1 to "
         f"{C.STATE_FORMAT}")]],
    ("sample", ["--checkpoint", "{tmp}/w-str"], "error: weights {tmp}/w-str could not be loaded: ConfigError: invalid "
     "configuration: - hidden_size must be a positive integer, got '64'",
     weights_folder("w-str", lambda cfg: {**cfg, "hidden_size": "64"})),
    ("sample", ["--checkpoint", "{tmp}/w-other"], "error: weights {tmp}/w-other: its weights do not match its "
     "model_config: lm_head.weight is [256, 64], the config makes it [256, 128]",
     weights_folder("w-other", lambda cfg: {**cfg, "hidden_size": 128})),
    ("sample", ["--checkpoint", "{tmp}/w-list"], "error: weights {tmp}/w-list: its model_config is a list, not a mapping of fields",
     weights_folder("w-list", lambda cfg: [1])),
    *[(tool, argv, f"error: {{tmp}}/run1{what}", best_json(case))
      for tool, argv in [("export", ["--checkpoint", "{tmp}/run1/best", "--output", "{tmp}/out"]),
                         ("sample", ["--checkpoint", "{tmp}/run1/best"]),
                         ("evaluate", ["--checkpoint", "{tmp}/run1/best", "--tasks", "{tmp}/tasks.yaml", "--output",
                                       "{tmp}/eval.jsonl"])]
      for case, what in [
        ("no best yet", " has no best checkpoint yet (best.json): it is written when a run evaluates its "
                        "checkpoints (ray_jobs.pretrain --eval-tasks ...)"),
        ("gone", f"/{C.BEST} names checkpoint_00000006 (step 6, eval/held/bpb 1), which no longer exists…"),
        ("replaced", f"/{C.BEST} names checkpoint_00000004, but that folder no longer holds the weights it scored…"),
        ("damaged", f"/{C.BEST} is unreadable…")]],
    # relative paths: the cases run in their folder
    ("evaluate", ["--tasks", "t.yaml", "--output", "o.jsonl"], "error: give --checkpoint PATH (repeatable) or --run-dir DIR"),
    ("evaluate", ["--checkpoint", "nowhere", "--tasks", "tasks.yaml", "--output", "o.jsonl"],
     "error: checkpoint nowhere does not exist"),
    ("evaluate", ["--run-dir", "nowhere", "--tasks", "tasks.yaml", "--output", "o.jsonl"], "error: … no such folder…"),
    *[("evaluate", ["--run-dir", "s3://bucket/run1", *follow, "--tasks", "tasks.yaml", "--output", "o.jsonl"],
       "error: --run-dir s3://bucket/run1: only a local run folder can be evaluated (copy it here first)")
      for follow in ([], ["--follow"])],
    ("evaluate", ["--checkpoint", ".", "--tasks", "missing.yaml", "--output", "o.jsonl"],
     "error: task list missing.yaml does not exist"),
    ("plot", ["--run-dir", "{tmp}/run"], "error: {tmp}/run: no such run folder"),
    ("plot", ["--run-dir", "{tmp}/r1"], "error: {tmp}/r1/metrics.jsonl: not found (is {tmp}/r1 a run folder of ray_jobs.pretrain "
     "with a local --run-dir?)", named("r1", lambda tmp: (tmp / "r1").mkdir())),
    ("plot", ["--run-dir", "{tmp}/r2"], "error: {tmp}/r2/metrics.jsonl: no metrics records yet (the run reports every --log-every "
     "steps)", named("r2", lambda tmp: ((tmp / "r2").mkdir(), (tmp / "r2" / "metrics.jsonl").write_text("\n")))),
    ("plot", ["--run-dir", "{tmp}/r3", "--output", "{tmp}/x.pdf"], "error: --output {tmp}/x.pdf: expected a .png file",
     named("r3", lambda tmp: write_run(tmp / "r3", [1], {1: 1}))),
]
# What state.json holds beside the fields these tests vary (a resume refuses a state.json without them).
RESUME_POSITION = {"world_size": 1, "accumulation_steps": 4,
                   "nonfinite_guard": {"skipped_total": 0, "in_a_row": 0, "first_step_in_a_row": 0}}
MODULES = {"pretrain": pretrain, "prepare": prepare, "tune": tune, "export": export, "train": train_cli,
           "sample": sample, "evaluate": evaluate, "plot": plot}


def case_id(command: str, argv: list[str], message: str, setup=None) -> str:
    return f"{command}:{setup.__name__ + ':' if setup else ''}{' '.join(argv)[:40]}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command,argv,message,setup", [(*c, None)[:4] for c in CASES],
                         ids=[case_id(*c) for c in CASES])
def test_wrong_invocation_is_one_clear_error(ray_address, data, tmp_path, capsys, monkeypatch, command, argv, message,
                                             setup):
    setup_files(tmp_path)
    if setup:
        setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = [a.format(data=data, tmp=tmp_path) for a in argv]
    if command in ("pretrain", "tune"):
        argv += ["--run-dir", str(tmp_path / "runs" / "bad")]
    before = tree(tmp_path)
    code = MODULES[command].main(argv)
    out, err = capsys.readouterr()
    assert code == 2, err
    if message.startswith("error: "):  # the whole of stderr, and nothing on stdout
        message = message.replace("{tmp}", str(tmp_path))
        assert matches(err, message + ("" if message.endswith("…") else "\n")) and err.endswith("\n"), err
        assert message.count("\n") == err.count("\n") - 1 and out == "", (err, out)
    else:
        assert message in err, err
        error_lines = [line for line in err.splitlines() if "error:" in line]  # or argparse's "prog: error: ..."
        assert len(error_lines) == 1, err
    assert "Traceback" not in err
    assert tree(tmp_path) == before  # nothing written, no run folder


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["/proc/forbidden/runs", "{tmp}/a-file/runs"])
def test_a_storage_path_that_cannot_be_written_is_one_line_before_ray(data, tmp_path, capsys, where):
    (tmp_path / "a-file").write_text("not a folder")
    storage = where.format(tmp=tmp_path)
    code = pretrain.main(["--data", str(data), *TINY, "--run-dir", f"{storage}/x"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"error: run folder {storage}/x: cannot create or write there (") \
        and err.count("\n") == 1, err
    assert not (tmp_path / "a-file").is_dir()


@pytest.mark.parametrize("refusal,message", [
    ("token", "it refused this process's authentication token (the cluster has token authentication on): set "
              "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN"),
    ("down", "nothing answered there; is the cluster up (`ray status --address 10.9.9.9:6379`)?"),
])
def test_a_cluster_that_cannot_be_joined_is_one_line(data, tmp_path, capsys, monkeypatch, refusal, message):
    """RAY_ADDRESS naming a cluster that refuses the token, or nothing: Ray raises a ConnectionError (from an
    AuthenticationError) after its retries, which used to end the driver in a 40-line traceback."""
    import ray
    import ray.exceptions

    def refuse(*args, **kwargs):
        # as Ray 2.60 raises them: the AuthenticationError is only in the text of the RuntimeError it chains
        cause = RuntimeError("Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n"
                             + ("ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: Authentication token "
                                "is missing or incorrect." if refusal == "token" else "RpcError: failed to connect"))
        raise ConnectionError("Failed to connect to Ray cluster at 10.9.9.9:6379") from cause

    monkeypatch.setenv("RAY_ADDRESS", "10.9.9.9:6379")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    code = pretrain.main(["--data", str(data), *TINY, "--run-dir", str(tmp_path / "runs" / "x")])
    err = capsys.readouterr().err
    assert code == 2 and err == f"error: cannot join the Ray cluster at RAY_ADDRESS=10.9.9.9:6379: {message}" + (
        " to the cluster's token (or RAY_AUTH_TOKEN_PATH to its file)\n" if refusal == "token" else "\n"), err


def test_the_demo_preset_stays_out_of_runs_on_real_data(data):
    from minilm.cli import DEMO_PRESET
    from minilm.config import ModelConfig, TrainConfig
    from minilm.options import build_configs
    from ray_jobs.cli import RayOptions
    from ray_jobs.pretrain import build_parser

    real = build_configs(build_parser().parse_args(["--data", str(data)]), {}, RayOptions, demo=False)
    assert real.model == ModelConfig() and real.train == TrainConfig()  # MiniMind's defaults, as README says
    demo = build_configs(build_parser().parse_args([]), {}, RayOptions, demo=True)
    assert demo.model.hidden_size == DEMO_PRESET["hidden_size"] and demo.train.max_steps == DEMO_PRESET["max_steps"]


def test_at_least_25_cases():
    assert len(CASES) >= 25
    assert {c[0] for c in CASES} == set(MODULES)



@pytest.mark.timeout(120)
def test_resuming_with_other_data_or_model_is_refused_before_start(ray_address, data, tmp_path, capsys):
    import torch

    from minilm.config import ModelConfig, TrainConfig
    from minilm.model import MiniMindForCausalLM
    from minilm.step import make_grad_scaler, make_optimizer

    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = MiniMindForCausalLM(cfg)
    tcfg = TrainConfig(seq_len=32, micro_batch_size=4, global_batch_size=16, max_steps=4, warmup_steps=1)
    state = {"optimizer_step": 2, "global_batch_size": 16, "model_config": cfg.to_dict(),
             "train_config": tcfg.to_dict(), "data_fingerprint": "0" * 64, **RESUME_POSITION}
    ckpt = tmp_path / "runs" / "old" / "checkpoint_00000002"
    save_resume_state(ckpt, model=model, optimizer=make_optimizer(model, tcfg),
                      scaler=make_grad_scaler(torch.float32, "cpu"), state=state)
    before = sorted(str(p) for p in tmp_path.rglob("*"))
    code = pretrain.main(["--data", str(data), *TINY, "--run-dir", str(tmp_path / "runs" / "old")])
    err = capsys.readouterr().err
    assert code == 2 and "cannot resume from" in err and "data fingerprint" in err and "another --run-dir" in err, err
    code = pretrain.main(["--data", str(data), *TINY, "--hidden-size", "128", "--run-dir",
                          str(tmp_path / "runs" / "old")])
    err = capsys.readouterr().err
    assert code == 2 and "model config differs from the checkpoint's (hidden_size" in err, err
    code = pretrain.main(["--data", str(data), *TINY, "--run-dir", str(tmp_path / "runs" / "old"),
                          "--resume", str(ckpt)])
    err = capsys.readouterr().err  # the run's newest checkpoint by its path: the same check
    assert code == 2 and f"cannot resume from {ckpt}" in err and "data fingerprint" in err, err
    assert sorted(str(p) for p in tmp_path.rglob("*")) == before


@pytest.mark.timeout(120)
def test_resuming_with_another_schedule_or_optimizer_needs_allow_config_change(ray_address, data, tmp_path, capsys):
    """lr / warmup / betas / weight decay / steps changed on resume: refused, or with --allow-config-change each
    change is said and used; a safe change (log interval) passes with a note; fp16 never swaps in mid-run."""
    import json

    import torch

    from minilm.config import ModelConfig, TrainConfig
    from minilm.model import MiniMindForCausalLM
    from minilm.step import make_grad_scaler, make_optimizer
    from ray_jobs.pretrain import build_parser, plan_run

    prepared_fp = json.loads((data / "manifest.json").read_text())["fingerprint"]
    cfg = ModelConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4)
    tcfg = TrainConfig(seq_len=32, micro_batch_size=4, global_batch_size=16, max_steps=4, warmup_steps=1, dtype="fp32")
    model = MiniMindForCausalLM(cfg)
    state = {"optimizer_step": 2, "global_batch_size": 16, "model_config": cfg.to_dict(), "dtype": "float32",
             "train_config": tcfg.to_dict(), "data_fingerprint": prepared_fp, "val_samples": 0, **RESUME_POSITION}
    save_resume_state(tmp_path / "runs" / "r" / "checkpoint_00000002", model=model,
                      optimizer=make_optimizer(model, tcfg), scaler=make_grad_scaler(torch.float32, "cpu"),
                      state=state)
    base = ["--data", str(data), "--hidden-size", "64", "--num-hidden-layers", "2", "--vocab-size", "256",
            "--seq-len", "32", "--micro-batch-size", "4", "--global-batch-size", "16", "--max-steps", "4",
            "--warmup-steps", "1", "--run-dir", str(tmp_path / "runs" / "r")]

    def plan(*extra):
        return plan_run(build_parser().parse_args([*base, *extra]))

    code = pretrain.main([*base, "--lr", "1e-3", "--betas", "0.9", "0.99", "--dtype", "fp32"])
    err = capsys.readouterr().err
    assert code == 2 and "cannot resume from" in err and "betas [0.9, 0.95] -> [0.9, 0.99]" in err \
        and "lr 0.0005 -> 0.001" in err and "--allow-config-change" in err, err
    allowed = plan("--lr", "1e-3", "--allow-config-change", "--dtype", "fp32")
    out = capsys.readouterr().out
    assert "note: resuming with lr 0.0005 -> 0.001 (--allow-config-change)" in out and allowed.train_cfg.lr == 1e-3
    safe = plan("--log-every", "1")
    assert "note: resuming with log_every 10 -> 1" in capsys.readouterr().out and safe.train_cfg.dtype == "fp32"
    auto = plan()  # --dtype auto on resume: the checkpoint's precision, not a new probe
    assert auto.train_cfg.dtype == "fp32"
    code = pretrain.main([*base, "--dtype", "bf16"])
    assert code == 2 and "dtype fp32 -> bf16" in capsys.readouterr().err
    code = pretrain.main([*base, "--dtype", "fp16", "--use-gpu", "false"])
    assert code == 2 and "--dtype fp16 needs GPU workers" in capsys.readouterr().err


def test_a_precision_change_is_refused_unless_it_is_fp32_bf16():
    """One precision per run. fp16 has GradScaler state bf16/fp32 lack (its loss scale; loading a bf16
    checkpoint's empty scaler state into an fp16 GradScaler raises), so no resume swaps fp16 in or out; fp32 <->
    bf16 keeps fp32 master weights and optimizer state, so --allow-config-change may switch it on purpose."""
    from minilm import checkpoint as C
    from minilm.config import ModelConfig, TrainConfig

    cfg = ModelConfig()
    state = {"global_batch_size": 64, "model_config": cfg.to_dict(), "data_fingerprint": "f",
             "train_config": TrainConfig(dtype="bf16").to_dict()}
    def changes(dtype: str):
        return C.check_resume(state, "c", cfg, TrainConfig(dtype=dtype), "f", allow_config_change=True)

    for asked in ("fp32", "bf16", "auto"):
        changes(asked)
    with pytest.raises(C.CheckpointError, match="dtype fp16 != bf16 in the checkpoint"):
        changes("fp16")
    assert [(c.name, c.before, c.after, c.safe) for c in changes("fp32")] == [("dtype", "bf16", "fp32", False)]
    assert C.config_changes(state, TrainConfig(dtype="auto")) == []


def test_muons_settings_are_no_change_to_an_adamw_run_and_a_change_to_a_muon_run():
    """An AdamW run never reads muon_lr, muon_momentum or embedding_lr_ratio: resuming one with other values (today's
    defaults against an older checkpoint's) changes nothing and is not refused; in a Muon run each is a change."""
    from minilm import checkpoint as C
    from minilm.config import TrainConfig

    muon_settings = dict(muon_lr=0.01, muon_momentum=0.9, embedding_lr_ratio=1.0)
    for optimizer, changed in (("adamw", []), ("muon", sorted(muon_settings))):
        state = {"train_config": TrainConfig(optimizer=optimizer, **muon_settings).to_dict()}
        assert [c.name for c in C.config_changes(state, TrainConfig(optimizer=optimizer))] == changed, optimizer
