"""One vocabulary for every command (minilm.cli): a bad flag is two lines and exit 2, Ctrl-C one line and exit 130,
--help names the new flags with every default, and the old spellings still parse, with a note."""

from __future__ import annotations

import argparse
import importlib

import pytest

from minilm import cli

# Every command: (module, the flags it requires, the names its --help must list, old names it must not show).
COMMANDS = [
    ("ray_jobs.pretrain", [], ["--run-dir", "--resume auto|never|PATH", "--data"], ["--storage-path", "--name "]),
    ("ray_jobs.tune", [], ["--run-dir", "--resume [{auto,never}]", "--search"],
     ["--storage-path", "--name ", "--num-workers", "--abandon-newer"]),
    ("ray_jobs.prepare", ["--input", "x", "--output", "y"], ["--input", "--output", "--tokenizer"], []),
    ("ray_jobs.export", ["--checkpoint", "x", "--output", "y"], ["--checkpoint", "--output", "--format"], []),
    ("ray_jobs.evaluate", ["--tasks", "t", "--output", "o"], ["--checkpoint", "--run-dir", "--output"], ["--run "]),
    ("ray_jobs.plot", [], ["--run-dir", "--output"], ["RUN_DIR [", "--out "]),
    ("ray_jobs.demo_tasks", ["--output", "x"], ["--output", "--items"], []),
    ("minilm.train", [], ["--run-dir", "--resume auto|never|PATH", "--data"], []),
    ("minilm.sample", ["--checkpoint", "x"], ["--checkpoint", "--prompt"], ["--weights"]),
]
IDS = [c[0] for c in COMMANDS]


def exit_code(main, argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own exit (prepare returns it)
        return e.code


@pytest.mark.parametrize("module, required, _new, _old", COMMANDS, ids=IDS)
def test_a_bad_flag_is_one_error_line_and_one_pointing_to_help(module, required, _new, _old, capsys):
    main = importlib.import_module(module).main
    assert exit_code(main, [*required, "--no-such-flag"]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["error: unrecognized arguments: --no-such-flag",
                                         f"see: python -m {module} --help"] and captured.out == ""


@pytest.mark.parametrize("module, _required, new, old", COMMANDS, ids=IDS)
def test_help_lists_the_new_names_and_every_default(module, _required, new, old, capsys):
    mod = importlib.import_module(module)
    assert exit_code(mod.main, ["--help"]) == 0
    parser = mod.build_parser()
    assert capsys.readouterr().out == parser.format_help()
    parser.epilog = None  # the docstring, which may name an old spelling as such
    text = " ".join(parser.format_help().split())  # argparse's line wrapping undone
    assert all(name in text for name in new), [n for n in new if n not in text]
    assert not any(name in text for name in old), [n for n in old if n in text]
    formatter = parser._get_formatter()
    for action in parser._actions:  # each flag shown says its default, 0 and False too, unless it is required
        if action.help is argparse.SUPPRESS or action.required or isinstance(action, argparse._HelpAction):
            continue
        assert "default" in formatter._get_help_string(action), (module, action.option_strings)
    if module in ("ray_jobs.pretrain", "minilm.train"):  # model/train flags: a meaning, 0/False defaults, choices
        assert "--warmup-steps WARMUP_STEPS optimizer steps of linear warmup (default: 0)" in text
        assert "--compile [{off,blocks,model}] torch.compile: blocks, each transformer block; model, the whole " \
               "forward with the loss's chunked head (one graph); off (default: off)" in text
        assert "--optimizer {auto,adamw,muon}" in text and "--schedule {cosine,wsd}" in text


@pytest.mark.parametrize("module", IDS)
def test_ctrl_c_is_one_line_and_exit_130(module, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli.ArgumentParser, "parse_known_args", interrupted)
    assert importlib.import_module(module).main([]) == 130
    captured = capsys.readouterr()
    assert captured.err.startswith("error: interrupted") and captured.err.count("\n") == 1 and captured.out == ""
    if module in ("ray_jobs.pretrain", "ray_jobs.tune"):  # a run or sweep says how it continues
        assert captured.err.endswith("with --resume auto and the same --run-dir\n")


def note(old: str, new: str) -> str:
    return f"note: {old} is now {new} (the old spelling goes in the next release)\n"


def test_old_spellings_parse_as_the_new_flags_with_a_note(capsys):
    from minilm import sample
    from ray_jobs import evaluate, plot, pretrain

    assert sample.build_parser().parse_args(["--weights", "w"]).checkpoint == "w"
    assert capsys.readouterr().err == note("--weights", "--checkpoint")
    args = evaluate.build_parser().parse_args(["--run", "r", "--tasks", "t", "--output", "o"])
    assert args.run_dir == "r" and capsys.readouterr().err == note("--run", "--run-dir")
    assert plot.build_parser().parse_args(["--run-dir", "a", "--out", "x.png"]).output == "x.png"
    assert capsys.readouterr().err == note("--out", "--output")
    assert plot.main(["nowhere", "--run-dir", "there"]) == 2  # the old positional RUN_DIRs: noted, then read
    assert capsys.readouterr().err.splitlines() == [note("RUN_DIR...", "--run-dir RUN_DIR...").strip(),
                                                    "error: there: no such run folder"]
    args = pretrain.build_parser().parse_args(["--storage-path", "/r", "--name", "n"])
    assert (args.storage_path, args.name) == ("/r", "n")
    assert capsys.readouterr().err == note("--storage-path", "--run-dir STORAGE/NAME") + \
        note("--name", "--run-dir STORAGE/NAME")


def test_tune_resume_alone_is_resume_auto_with_a_note(capsys):
    from ray_jobs import tune

    assert tune.build_parser().parse_args(["--resume"]).resume == "auto"
    assert tune.build_parser().parse_args([]).resume == "never"  # a sweep is never continued unasked
    assert exit_code(tune.main, ["--resume", "--no-such-flag"]) == 2
    assert capsys.readouterr().err.splitlines()[0] == note("--resume alone", "--resume auto").strip()


@pytest.mark.parametrize("run_dir, storage, name", [
    ("runs/run1", "runs", "run1"), ("run1", ".", "run1"), ("/abs/runs/r/", "/abs/runs", "r"),
    ("s3://bucket/runs/r1", "s3://bucket/runs", "r1"), ("s3://bucket/r1?region=eu", "s3://bucket?region=eu", "r1"),
])
def test_run_dir_is_pretrains_storage_path_and_name(run_dir, storage, name):
    from ray_jobs.cli import apply_run_dir

    args = argparse.Namespace(run_folder=run_dir, storage_path=None, name=None)
    apply_run_dir(args)
    assert (args.storage_path, args.name) == (storage, name)


@pytest.mark.parametrize("run_dir, storage, name, message", [
    ("s3://bucket", None, None, "expected a run folder"), ("/", None, None, "expected a run folder"),
    ("runs/a", "runs", None, "not both"), ("runs/a", None, "a", "not both"),
])
def test_run_dir_refusals(run_dir, storage, name, message):
    from ray_jobs.cli import UsageError, apply_run_dir

    with pytest.raises(UsageError, match=message):
        apply_run_dir(argparse.Namespace(run_folder=run_dir, storage_path=storage, name=name))
