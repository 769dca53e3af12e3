"""Every command of README.md, docs/*.md and cluster/README.md, read from the files themselves and run (issue 47).

A documented command is a line of a code block (indented or fenced) that starts with a program of `PROGRAMS`, its
`\\` continuation lines joined; a `...` among its arguments stands for those of the same module's command above it.
What is done with it follows from its program and module (`action`), so a new command of a known kind is run with
no edit here, and one of an unknown kind fails `test_every_documented_command_has_an_action`:

- run: to the end on small data, in this process, in a folder of its own (`quick`): README's prepare on a small
  corpus, its `minilm.train` on a tiny model for 2 steps (`QUICK_FLAGS`), then what reads that run (evaluate, export,
  sample, plot); the sizes and paths that differ from the documented ones are `QUICK_FLAGS` and `PATHS`;
- dry-run: with --dry-run, every check of the run (flags, configs, data, run folder and --resume, cluster) against
  the session's Ray and a moto S3 server for `s3://` run folders, in a folder whose files are compared before and
  after (`dry`: a dataset big enough for every documented batch, warmup and held-out set): pretrain and tune at their
  documented sizes, the entrypoints of `ray job submit`, torchrun's `minilm.train` (2 processes);
- parse: the program's own parser reads it (Ray's click CLI, TensorBoard's flags, `make -n`), nothing is run;
- not run here, with the reason (an install, a Kubernetes cluster, a GPU machine, ...), or run by the test named.

Besides, without Ray or data (the fast suite): the flags of every command are checked by its own parser
(`test_documented_flags_exist`), and so are those of the `python -m ...` and `ray ...` commands the prose names in
backquotes. The outputs the docs quote are compared with what the commands print (`test_quoted_outputs_...`; the
README's demo console: tests/test_pretrain.py). `python tests/test_documented_commands.py` lists every command and
what is done with it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import io
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
from helpers import ROOT, assert_quoted, free_port, make_prepared, quoted_block, sigterm_kept, tree

DOCS = ("README.md", *(f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))), "cluster/README.md")

# The first word of a command (after NAME=value assignments); also `eval "...`, `{ ...` (a shell group) and a
# device tool's `command: ...` (docs/gpu.md). No output or listing the docs quote starts so.
PROGRAMS = frozenset({
    "python", "python3", ".venv/bin/python", "torchrun", "minilm", "ray", "make", "pip", "pip3", "bash", "sh",
    "kubectl", "docker", "helm", "tensorboard", "mlflow", "lm_eval", "llama-cli", "curl", "wget", "git", "export",
    "source", "cd", "cat", "pytest", "uv", "conda", "sudo", "apt-get", "aws", "gcloud", "accelerate", "srun", "sbatch"})

RUN, DRY, PARSE, ELSEWHERE, NOT_RUN = "run", "dry-run", "parse", "elsewhere", "not run"

# python -m MODULE: how its documented commands are run, and why so.
MODULES = {
    "ray_jobs.prepare": (RUN, "on a small corpus of made-up words (two JSONL files)"),
    "ray_jobs.demo_tasks": (RUN, "the demo's task list, from this Python's standard library"),
    "minilm.train": (RUN, "a tiny model for 2 steps (QUICK_FLAGS): the run the commands below read"),
    "ray_jobs.evaluate": (RUN, "the tiny run's checkpoints on small task files"),
    "ray_jobs.export": (RUN, "the tiny run's checkpoint"),
    "minilm.sample": (RUN, "the tiny run's weights"),
    "ray_jobs.plot": (RUN, "the tiny run's metrics.jsonl"),
    "ray_jobs.pretrain": (DRY, "a run at its documented size: every check against the session's Ray"),
    "ray_jobs.tune": (DRY, "a sweep at its documented size: every check against the session's Ray"),
    "bench.minimind": (PARSE, "runs MiniMind's own script from a checkout for an hour: its flags parsed (then a "
                              "missing checkout refused); tests/test_minimind_bench.py runs it on a stand-in"),
    "pytest": (NOT_RUN, "the test suite itself: its paths and markers checked"),
}
# Other programs: how, and why.
PROGRAM_ACTIONS = {
    "ray": (PARSE, "acts on a cluster (AWS, a job): Ray's own CLI parses it"),
    "make": (PARSE, "`make -n` prints the target's commands without running them; its python command is then run as "
                    "the docs' own"),
    "tensorboard": (PARSE, "a web server: TensorBoard's own flag parser reads the command, nothing is served"),
    "cluster/local.sh": (ELSEWHERE, "tests/test_job_submit.py starts, uses and stops a local head with it"),
    "eval": (ELSEWHERE, "tests/test_job_submit.py sets the environment `cluster/local.sh env` prints"),
    "{": (RUN, "bash, on stand-in C-Eval files; the task list it writes is loaded"),
    "pip": (NOT_RUN, "installs packages; the extras it names are checked against pyproject.toml"),
    "export": (NOT_RUN, "sets the shell's environment for the commands after it"),
    "kubectl": (NOT_RUN, "needs a Kubernetes cluster with KubeRay; the manifests it applies exist and "
                         "tests/test_cluster_configs.py checks them offline"),
    "docker": (NOT_RUN, "needs a Docker daemon and a registry; tests/test_cluster_configs.py checks cluster/Dockerfile"),
    "mlflow": (NOT_RUN, "MLflow's web UI, of the full `mlflow` package (the [mlflow] extra is the client only)"),
    "lm_eval": (NOT_RUN, "lm-eval-harness (the [eval] extra) downloads HellaSwag, which this machine cannot; "
                         "tests/test_lm_eval.py runs `lm_eval --model hf` offline on a local task where it is installed"),
    "llama-cli": (NOT_RUN, "llama.cpp is not installed here; tests/test_gguf_export.py runs llama.cpp through "
                           "llama-cpp-python where it is"),
    "bench/gpu_check.sh": (NOT_RUN, "the lent GPU machine's check (docs/gpu.md); its CPU dry run is "
                                    "tests/test_gpu_check.py's rehearsal (make rehearsal)"),
}
GGUF_MISSING = "the gguf package (the [gguf] extra, in dev) is not installed: its flags parsed; " \
               "tests/test_gguf_export.py writes and reads the file where it is"

# Documented paths -> the ones used here; relative paths stay as written (each command runs in its workspace).
QUICK_LAST = "checkpoint_00000002"  # the tiny run's last checkpoint (2 steps, one every step)
PATHS = {
    "/shared/data/tok": "data/tok",
    "/shared/corpus/": "corpus/",
    "/shared/runs/": "shared-runs/",
    "/tmp/minilm-runs/": "tmp-runs/",
    "runs/<run>/weights": f"runs/run1/{QUICK_LAST}/weights",  # where pretrain's summary copies the last export
    "checkpoint_00001000": QUICK_LAST,
    "runs/run1": "runs/local1",  # the run README's `python -m minilm.train ... --run-dir runs/local1` makes
    "runs/run2": "runs/local2",  # a copy of it
    "~/src/minimind": "no-minimind-checkout",  # bench.minimind: parsed only
}
S3_BUCKETS = ("s3://bucket/", "s3://my-bucket/")  # -> the same bucket of the session's moto server
# Added to a command run to the end (its documented value replaced).
QUICK_FLAGS = {"minilm.train": ["--max-steps", "2", "--hidden-size", "64", "--num-hidden-layers", "2",
                                "--num-attention-heads", "4", "--num-key-value-heads", "2", "--micro-batch-size", "2",
                                "--global-batch-size", "4", "--checkpoint-every", "1", "--log-every", "1",
                                "--dtype", "fp32"]}
DRY_DATA_SEQUENCES = 16384  # README's sweep: 256 held out, then more than its 200-step warmup of 64 sequences


# ---- the commands, from the docs ------------------------------------------------------------------------

@dataclass(frozen=True)
class Command:
    doc: str
    line: int
    text: str  # as documented: continuation lines joined, a trailing comment left out
    expanded: str = ""  # `...` replaced by the arguments it stands for

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def words(self) -> list[str]:
        return shlex.split(self.expanded or self.text)

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def program_of(line: str) -> str | None:
    """The program a code line starts, or None (an output, a listing, code)."""
    body = line.lstrip("#").strip().removeprefix("command: ")
    if re.match(r'eval ["$]', body) or re.match(r"\{ \w", body):
        return body.split()[0]
    first = re.match(r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(\S*)", body).group(1)
    return first if first in PROGRAMS or first.endswith(".sh") else None


def code_lines(text: str):
    """(line number, the line stripped) in code blocks; (line number, None) outside them."""
    fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fence = not fence
            yield n, None
        elif fence or line.startswith("    "):
            yield n, line.strip()
        else:
            yield n, None


def extract(doc: str) -> list[Command]:
    """The commands of one doc: a `\\` at the end of a line joins the next; a shell group `{ ...` runs to its `}`."""
    found, parts, start = [], [], 0
    for n, line in [*code_lines((ROOT / doc).read_text()), (0, None)]:
        if parts and line is not None:
            parts.append(without_comment(line))
        elif line and program_of(line):
            start, parts = n, [without_comment(line.lstrip("#").strip().removeprefix("command: "))]
        continued = parts and (parts[-1].endswith("\\") or
                               (parts[0].startswith("{ ") and not re.search(r"[;\s]}", parts[-1])))
        if parts and (line is None or not continued):
            text = parts[0]
            for prev, part in zip(parts, parts[1:], strict=False):  # `\` joins words, a shell group its lines
                text = text.removesuffix("\\").rstrip() + (" " if prev.endswith("\\") else "\n") + part
            found.append(Command(doc, start, text))
            parts = []
    return found


def without_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line)


def module_of(words: list[str]) -> str | None:
    return words[words.index("-m") + 1] if "-m" in words and words.index("-m") + 1 < len(words) else None


def documented_commands() -> list[Command]:
    """Every command of the docs, in order (README, docs/, cluster/README), `...` expanded."""
    commands = [c for doc in DOCS for c in extract(doc)]
    out = []
    for c in commands:
        words = c.text.split()
        module = module_of(words)
        if "..." in words and module:
            plain = [d for d in commands if module_of(d.text.split()) == module and "..." not in d.text.split()]
            above = [d for d in plain if d.doc == c.doc and d.line < c.line]
            base = (above or plain)[-1 if above else 0]
            c = replace(c, expanded=c.text.replace(" ... ", " " + base.text.split(f"-m {module}", 1)[1].strip() + " "))
        out.append(c)
    return out


# ---- what is done with each -------------------------------------------------------------------------------

@dataclass
class Action:
    how: str
    why: str
    module: str | None = None  # python -m MODULE: its arguments below
    args: list[str] = field(default_factory=list)  # [optional] groups out, documented paths replaced (PATHS)
    optional: list[str] = field(default_factory=list)  # the flags of [optional] groups: they must exist
    then: Command | None = None  # ray job submit's entrypoint, the command `make -n` shows
    torchrun: list[str] | None = None  # torchrun's own flags

    def __str__(self) -> str:
        text = f"{self.how}: {self.why}"
        return text + (f"; then {self.then.text!r}: {action(self.then)}" if self.then else "")


def split_optional(words: list[str]) -> tuple[list[str], list[str]]:
    """Words outside `[...]` groups, and the flags inside them."""
    kept, flags, depth = [], [], 0
    for w in words:
        depth += w.startswith("[")
        if depth:
            flags += [f for f in w.strip("[]").split("|") if f.startswith("--")]
        else:
            kept.append(w)
        depth -= w.endswith("]")
    return kept, flags


def local_path(word: str) -> str:
    for documented, here in PATHS.items():
        word = word.replace(documented, here)
    return word


def program_words(c: Command) -> tuple[str, list[str]]:
    """The program `c` runs (a script run by bash: the script) and its words, NAME=value assignments left out."""
    words = c.words
    while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
        words = words[1:]
    if words[0] in ("bash", "sh") and len(words) > 1 and words[1].endswith(".sh"):
        words = words[1:]
    return words[0], words


@functools.cache
def action(c: Command) -> Action | None:
    """How `c` is run (None: nothing here knows its program)."""
    prog, words = program_words(c)
    if prog in ("python", "python3", ".venv/bin/python", "minilm", "torchrun"):
        if words[1:2] == ["-c"]:
            return Action(NOT_RUN, "a line of Python that checks an install (whether torch sees a GPU)")
        if prog == "minilm":
            from ray_jobs.__main__ import COMMANDS

            module, rest = COMMANDS[words[1]][0] if words[1] in COMMANDS else words[1], words[2:]
        else:
            module, rest = module_of(words), words[words.index("-m") + 2:] if "-m" in words else []
        if module not in MODULES:
            return None
        how, why = MODULES[module]
        args, optional = split_optional([local_path(w) for w in rest])
        a = Action(how, why, module, args, optional)
        if prog == "torchrun":
            a.how, a.why = DRY, f"under torchrun ({' '.join(words[1:words.index('-m')])}) on the dry run's data"
            a.torchrun = words[1:words.index("-m")]
        elif module == "ray_jobs.export" and "gguf" in args and importlib.util.find_spec("gguf") is None:
            a.how, a.why = PARSE, GGUF_MISSING
        return a
    if prog == "ray" and words[1:3] == ["job", "submit"] and "--" in words:
        entry = shlex.join(words[words.index("--") + 1:])
        then = Command(c.doc, c.line, entry)
        return Action(PARSE, "Ray's CLI parses the submission", args=words[1:], then=then) \
            if action(then) is not None else None
    if prog == "make":
        shown = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
        python = [line for line in shown.stdout.splitlines() if " -m " in line]
        return Action(*PROGRAM_ACTIONS["make"], args=words[1:],
                      then=Command(c.doc, c.line, python[-1].strip()) if python else None)
    if prog == "eval" and "cluster/local.sh" not in c.text:
        return None
    how_why = PROGRAM_ACTIONS.get(prog) or PROGRAM_ACTIONS.get(prog.removeprefix("./"))
    return Action(*how_why, args=words[1:]) if how_why else None


# ---- flags, without Ray or data --------------------------------------------------------------------------

def ray_cli_context(words: list[str]):
    """Ray's click CLI parsing `ray WORDS` down to its subcommand (click.UsageError for an unknown one or flag)."""
    import click
    from ray.scripts.scripts import cli

    ctx = cli.make_context("ray", list(words))
    while isinstance(ctx.command, click.Group):
        rest = [*ctx.__dict__.get("_protected_args", ctx.__dict__.get("protected_args", [])), *ctx.args]
        if not rest:
            break
        name, sub, rest = ctx.command.resolve_command(ctx, rest)
        ctx = sub.make_context(name, rest, parent=ctx)
    return ctx


def check_module_flags(a: Action) -> None:
    """The module's own parser reads the arguments (SystemExit for an unknown flag); pretrain's and tune's configs
    are checked as far as they can be without data and Ray (world sizes against the global batch)."""
    mod = importlib.import_module(a.module)
    if a.module == "bench.minimind":
        with contextlib.redirect_stderr(io.StringIO()) as err:
            assert mod.main(a.args) == 2 and "no such folder" in err.getvalue(), err.getvalue()  # parsed, then refused
        return
    if a.module == "pytest":
        config = (ROOT / "pyproject.toml").read_text()
        paths = [w for w in a.args if not w.startswith("-") and "/" in w]
        assert all((ROOT / p).exists() for p in paths), paths
        marks = [a.args[i + 1] for i, w in enumerate(a.args) if w == "-m"]
        assert all(f'"{m.split()[-1]}:' in config for m in marks), marks  # a registered marker
        return
    parser = mod.build_parser()
    ns = parser.parse_args(a.args)
    missing = [f for f in a.optional if f not in parser._option_string_actions]
    assert not missing, f"{a.module} has no flag {missing}"
    if a.module in ("ray_jobs.pretrain", "ray_jobs.tune"):
        from minilm.options import build_configs
        from ray_jobs.cli import RayOptions
        from ray_jobs.pretrain import check_options

        if a.module == "ray_jobs.tune":
            mod.search_space(ns.search, None)
            ns.num_workers = str(ns.workers_per_trial or 1)
        cfgs = build_configs(ns, {}, RayOptions, demo=not ns.data)
        check_options(*cfgs)


def check_flags(c: Command, a: Action) -> None:
    prog = program_words(c)[0]
    if a.module:
        check_module_flags(a)
    elif prog == "ray":
        ray_cli_context(a.args)
    elif prog == "tensorboard":
        from tensorboard import program

        program.TensorBoard().configure(argv=[None, *a.args])
    elif prog == "make":
        assert subprocess.run(["make", "-n", *a.args], cwd=ROOT, capture_output=True).returncode == 0
    elif prog == "pip":
        extras = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1].split("\n[")[0]
        for named in re.findall(r"\[([\w,]+)\]", c.text):
            assert all(re.search(rf"^{e} = ", extras, re.M) for e in named.split(",")), named
    elif prog in ("kubectl", "docker"):
        files = [a.args[i + 1] for i, w in enumerate(a.args) if w == "-f" and a.args[0] in ("apply", "delete", "build")]
        assert all((ROOT / f).is_file() for f in files), files
    elif prog.endswith(".sh") or "local.sh" in c.text:  # a script's verb and flags are in its own text
        script = next(w for w in re.split(r'[\s"$()]+', c.text) if w.endswith(".sh"))
        source = (ROOT / script).read_text()
        words = [w for w in re.split(r'[\s"$()]+', c.text.split(script, 1)[1].split("|")[0]) if w]
        verbs = words[:1] if words and not words[0].startswith("-") else []
        assert all(f"{w})" in source for w in verbs), verbs
        assert all(w in source for w in words if w.startswith("--")), words
    elif prog == "{":
        assert subprocess.run(["bash", "-n", "-c", c.text], capture_output=True).returncode == 0
    if a.then is not None:
        check_flags(a.then, action(a.then))


def mentioned_commands() -> list[Command]:
    """`python -m MODULE ...` and `ray ...` spans of the docs' text that name a flag: mentions, not always whole
    commands (a part of the GPU check, a command with its data left out), whose flags must exist all the same."""
    found = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for m in re.finditer(r"`((?:python3? -m [\w.]+|ray [a-z-]+)\s[^`]*--[^`]*)`", text):
            found.append(Command(doc, text.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split())))
    return found


def flags_of(c: Command) -> tuple[set[str], list[str]]:
    """The flags the program of a mention has (its subcommands' too), and those the mention names."""
    words = c.words[:c.words.index("--")] if "--" in c.words else c.words  # ray job submit's entrypoint: its own
    named = [w.split("=")[0] for w in words if w.startswith("--")]
    if words[0] == "ray":
        import click
        from ray.scripts.scripts import cli

        command = cli
        for name in words[1:]:
            if not isinstance(command, click.Group):
                break
            command = command.get_command(click.Context(command), name)
        return {o for p in command.params for o in p.opts}, named
    import argparse
    from unittest import mock

    class Built(Exception):
        pass

    def stop(parser, args=None, namespace=None):
        raise Built(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", stop):
        try:
            importlib.import_module(words[2]).main(words[3:])
            raise AssertionError(f"{words[2]}.main parsed no arguments")
        except Built as built:
            parser = built.args[0]
    parsers = [parser] + [sub for a in parser._actions if isinstance(a, argparse._SubParsersAction)
                          for sub in a.choices.values()]
    return {o for p in parsers for o in p._option_string_actions}, named


COMMANDS = documented_commands()
MENTIONED = mentioned_commands()


def test_the_docs_have_their_commands():
    """The extraction finds what the docs show: the README's, a continuation joined, `...` expanded."""
    texts = [c.text for c in COMMANDS]
    assert len(COMMANDS) >= 60 and {c.doc for c in COMMANDS} >= {"README.md", "cluster/README.md", "docs/export.md"}
    assert "make demo" in texts and any(t.startswith("python -m ray_jobs.pretrain --data data/tok --hidden-size 768")
                                        and t.endswith("--run-dir runs/run1") for t in texts)
    assert any(c.expanded.startswith("python -m ray_jobs.tune --data data/tok") for c in COMMANDS)
    assert not [c for c in COMMANDS if c.text.endswith("\\") or program_of(c.text) is None]


@pytest.mark.parametrize("c", COMMANDS, ids=lambda c: c.where)
def test_every_documented_command_has_an_action(c):
    assert action(c) is not None, (f"{c}: nothing here runs this program; give it an action (MODULES, "
                                   f"PROGRAM_ACTIONS) or change the docs")


@pytest.mark.parametrize("c", COMMANDS, ids=lambda c: c.where)
def test_documented_flags_exist(c):
    a = action(c)
    if a is None:
        pytest.fail(f"{c}: no action")
    try:
        check_flags(c, a)
    except SystemExit as e:  # argparse: an unknown flag or a bad value (its error line is on stderr)
        pytest.fail(f"{c}: its parser refused it (exit {e.code})")


@pytest.mark.parametrize("c", MENTIONED, ids=lambda c: f"{c.where} {c.text}")
def test_flags_of_commands_mentioned_in_the_text_exist(c):
    have, named = flags_of(c)
    assert set(named) <= have, f"{c}: {sorted(set(named) - have)} is no flag of it"


# ---- run: to the end on small data ---------------------------------------------------------------------

def small_corpus(folder: Path) -> None:
    """Two JSONL files of made-up words (a tokenizer learns them fast): what `corpus/*.jsonl` names."""
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "vo", "shi", "pe", "da", "gu", "ri", "so", "ba", "ze", "fo"]
    words = sorted({"".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(3000)})
    folder.mkdir(parents=True)
    for name in ("a", "b"):
        (folder / f"{name}.jsonl").write_text("".join(
            json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(20, 300))) + "."}) + "\n"
            for _ in range(200)))


def quick_tasks(folder: Path) -> None:
    """tasks.yaml of the tests' task files (tests/test_evaluate.py), the names docs/evaluation.md shows."""
    from test_evaluate import FACTS, PLACES, SENTENCES, facts_hellaswag, write_jsonl

    facts_hellaswag(folder / "facts.jsonl")
    (folder / "mmlu.csv").write_text("".join(f"Where does the {a} sleep?,{','.join(PLACES)},{'ABCD'[PLACES.index(p)]}\n"
                                             for a, p in FACTS))
    write_jsonl(folder / "held.jsonl", [{"text": s} for s in SENTENCES[:3]])
    (folder / "prompts.txt").write_text("the fox sleeps\n")
    (folder / "tasks.yaml").write_text("tasks:\n  - {name: facts, kind: hellaswag, path: facts.jsonl}\n"
                                       "  - {name: where, kind: choice, path: mmlu.csv}\n"
                                       "  - {name: held, kind: bpb, path: held.jsonl}\n"
                                       "  - {name: prompts, kind: generate, path: prompts.txt, max_new_tokens: 8}\n")


def ceval_files(folder: Path) -> None:
    """What the docs' shell loop reads: C-Eval's val and dev CSVs of one subject (header, A-D, answer)."""
    for split in ("val", "dev"):
        (folder / "ceval" / split).mkdir(parents=True)
        (folder / "ceval" / split / f"law_{split}.csv").write_text(
            "id,question,A,B,C,D,answer\n" + "".join(f"{i},Q{i}?,a,b,c,d,{'ABCD'[i % 4]}\n" for i in range(6)))


@dataclass
class Outcome:
    code: int | None
    out: str
    seconds: float = 0.0

    def __str__(self) -> str:
        return f"exit {self.code} after {self.seconds:.1f} s\n{self.out[-3000:]}"


def in_process(module: str, args: list[str], folder: Path) -> Outcome:
    """`python -m MODULE ARGS` as its main(argv), in `folder`; what it printed."""
    buf, t0 = io.StringIO(), time.time()
    try:
        with sigterm_kept(), contextlib.chdir(folder), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            code = importlib.import_module(module).main(args)
    except SystemExit as e:
        code = e.code
    return Outcome(code, buf.getvalue(), time.time() - t0)


def stage(c: Command, a: Action) -> int:
    """The order of the commands run to the end: what makes the data, the run, its scores and exports first."""
    if a.module in ("ray_jobs.prepare", "ray_jobs.demo_tasks"):
        return 0
    if a.module == "minilm.train":
        return 1
    if a.module == "ray_jobs.evaluate" and "--run-dir" in a.args:
        return 2  # then best.json, from its scores
    return 3 if a.module == "ray_jobs.export" else 4


@pytest.fixture(scope="module")
def quick(ray_address, tmp_path_factory):
    """Every command of the docs that runs to the end, in order, in one folder: {where: Outcome}, and the folder."""
    from minilm import checkpoint as C

    folder = tmp_path_factory.mktemp("quick")
    small_corpus(folder / "corpus")
    quick_tasks(folder)
    todo = [(c, b) for c in COMMANDS for a in [action(c)] if a is not None
            for b in [action(a.then) if a.then is not None else a] if b.how == RUN]
    outcomes, done = {}, {}
    for c, a in sorted(todo, key=lambda ca: stage(*ca)):
        if a.module is None:  # the shell loop, in a folder of its own
            loop = folder / "ceval-loop"
            ceval_files(loop)
            proc = subprocess.run(["bash", "-c", c.text], cwd=loop, capture_output=True, text=True)
            outcomes[c.where] = Outcome(proc.returncode, proc.stdout + proc.stderr)
            if proc.returncode == 0:
                from minilm.tasks import load_tasks

                outcomes[c.where].out += f"{len(load_tasks(loop / 'tasks.yaml'))} task(s) loaded"
            continue
        args = a.args
        if a.module in QUICK_FLAGS:
            extra = QUICK_FLAGS[a.module]
            args = [w for i, w in enumerate(args) if w not in extra[::2] and (i == 0 or args[i - 1] not in extra[::2])]
            args += extra
        key = (a.module, *args)
        if key in done:  # the same command (its paths mapped) documented twice: run once
            outcomes[c.where] = done[key]
            continue
        outcomes[c.where] = done[key] = in_process(a.module, args, folder)
        if a.module == "minilm.train":
            shutil.copytree(folder / "runs/local1", folder / "runs/local2")
        if stage(c, a) == 2 and not (folder / "runs/local1/best.json").exists():
            # the evaluator beside training writes best.json (docs/evaluation.md); here from these scores, its rule
            run = C.RunFolder(folder / "runs/local1")
            for r in map(json.loads, (folder / "runs/local1/eval.jsonl").read_text().splitlines()):
                if r["task"] == "held":
                    name = Path(r["checkpoint"]).name
                    C.update_best(run, "eval/held/bpb", name, r["step"], r["metrics"]["bpb"], r["weights_sha256"])
    return outcomes, folder


# ---- dry-run: every check, nothing started ------------------------------------------------------------------

@pytest.fixture(scope="module")
def dry(quick, tmp_path_factory):
    """The folder of the dry runs: a dataset big enough for every documented size, task lists."""
    folder = tmp_path_factory.mktemp("dry")
    make_prepared(folder / "data/tok", num_sequences=DRY_DATA_SEQUENCES, seq_len=512, vocab_size=6400,
                  rows_per_shard=4096)
    quick_tasks(folder)
    (folder / "hellaswag.jsonl").write_text((quick[1] / "facts.jsonl").read_text())
    tasks = (folder / "tasks.yaml").read_text()
    (folder / "tasks.yaml").write_text(tasks + "  - {name: hellaswag, kind: hellaswag, path: hellaswag.jsonl}\n")
    shutil.copytree(quick[1] / "tasks/demo", folder / "tasks/demo")
    return folder


def s3_args(args: list[str], server) -> list[str]:
    for bucket in S3_BUCKETS:
        args = [server.uri("bucket/" + w.removeprefix(bucket)) if w.startswith(bucket) else w for w in args]
    return args


def dry_run(a: Action, folder: Path, server, monkeypatch) -> None:
    from minilm.run import DRY_RUN

    args = s3_args(a.args, server)
    s3_before = s3_listing(server)
    before = tree(folder)
    monkeypatch.setenv("WANDB_MODE", "offline")  # --tracker wandb without an account (docs/tracking.md)
    if a.torchrun is not None:
        torchrun = Path(sys.executable).with_name("torchrun")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PET_MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
        proc = subprocess.run([str(torchrun), *a.torchrun, "-m", a.module, *args, "--dry-run"], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=300)
        outcome = Outcome(proc.returncode, proc.stdout + proc.stderr)
    else:
        outcome = in_process(a.module, [*args, "--dry-run"], folder)
    assert outcome.code == 0 and DRY_RUN in outcome.out, outcome
    assert tree(folder) == before, "a dry run wrote into its folder"
    assert s3_listing(server) == s3_before, "a dry run wrote to S3"


def s3_listing(server) -> list[tuple]:
    """Every object and folder in the bucket; a folder's mtime left out (S3 has none: the server makes one up)."""
    import pyarrow.fs as pafs

    infos = server.filesystem().get_file_info(pafs.FileSelector("bucket", recursive=True))
    return sorted((f.path, f.type.name, f.size, f.mtime if f.type == pafs.FileType.File else None) for f in infos)


RUNNABLE = [c for c in COMMANDS for a in [action(c)] if a is not None
            and (a.how in (RUN, DRY) or (a.then is not None and action(a.then).how in (RUN, DRY)))]


@pytest.mark.slow  # all of them: ~40 s, most of it the quick runs' Ray tasks and imports
@pytest.mark.ray
@pytest.mark.parametrize("c", RUNNABLE, ids=lambda c: c.where)
def test_documented_command_runs(c, quick, dry, s3, monkeypatch):
    a = action(c)
    a = action(a.then) if a.how not in (RUN, DRY) else a
    if a.how == RUN:
        assert quick[0][c.where].code == 0, f"{c}\n{quick[0][c.where]}"
    else:
        dry_run(a, dry, s3, monkeypatch)


# ---- what the docs quote -----------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.ray
def test_quoted_outputs_match_what_the_commands_print(quick):
    """The console table of docs/evaluation.md, and the files the docs list: a checkpoint (README), an HF export
    (docs/export.md), the manifest (docs/data.md), world_size.csv (docs/elastic.md), best.json and an evaluation
    record (docs/evaluation.md), against what the commands above wrote."""
    outcomes, folder = quick
    evaluate = next(c for c in COMMANDS if c.text.startswith("python -m ray_jobs.evaluate --run-dir runs/run1"))
    assert_quoted(quoted_block("docs/evaluation.md", "step  task"), outcomes[evaluate.where].out)

    run, last = folder / "runs/local1", folder / "runs/local1" / QUICK_LAST
    listed = {line.split()[0].rstrip("/") for line in quoted_block("README.md", "model.safetensors")
              if not line.startswith(" ")}
    assert listed == {p.name for p in last.iterdir()}
    listed = {line.split()[0] for line in quoted_block("docs/export.md", "config.json")}
    assert listed == {p.name for p in (folder / "out-hf").iterdir()}
    documented = set(re.findall(r'^  "(\w+)":', "\n".join(quoted_block("docs/data.md", "{")), re.M))
    written = json.loads((folder / "data/tok/manifest.json").read_text())
    assert documented == set(written), (sorted(documented), sorted(written))
    header = quoted_block("docs/elastic.md", "time,optimizer_step")[0]
    assert (run / "world_size.csv").read_text().splitlines()[0] == header
    best = json.loads(" ".join(quoted_block("docs/evaluation.md", '{"checkpoint"')))
    assert set(best) == set(json.loads((run / "best.json").read_text()))
    record = json.loads(re.sub(r"<[^>]*>", "x", " ".join(quoted_block("docs/evaluation.md", '{"task"'))))
    written = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert set(record) == set(next(r for r in written if r["kind"] == "hellaswag"))


def describe() -> str:
    """Every documented command and what the tests do with it."""
    rows = []
    for c in COMMANDS:
        a = action(c)
        shown = c.expanded or c.text
        rows.append(f"{c.where}\n    {shown}\n    -> {a if a else 'NO ACTION: fails the test'}")
    return "\n".join(rows)


if __name__ == "__main__":
    print(describe())
