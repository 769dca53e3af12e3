"""Every minilm command under one name: `minilm COMMAND ...` (or `python -m ray_jobs COMMAND ...`).

Each runs the main(argv) of its module, as `python -m MODULE ...` does (the form `ray job submit` uses).
`minilm COMMAND --help` lists that command's flags."""

from __future__ import annotations

import importlib
import sys

from minilm.cli import ArgumentParser

COMMANDS = {  # name -> (module, its line in --help)
    "prepare": ("ray_jobs.prepare", "tokenize and pack a corpus into token files"),
    "pretrain": ("ray_jobs.pretrain", "pretrain with Ray Train (no flags: the demo)"),
    "tune": ("ray_jobs.tune", "a Ray Tune sweep of pretrain runs"),
    "export": ("ray_jobs.export", "a checkpoint's weights for inference (hf, gguf, ...)"),
    "evaluate": ("ray_jobs.evaluate", "score checkpoints on task files"),
    "sample": ("minilm.sample", "a sampled continuation from a checkpoint"),
    "plot": ("ray_jobs.plot", "training curves from metrics.jsonl"),
    "train": ("minilm.train", "train without Ray: one process, or under torchrun"),
    "demo-tasks": ("ray_jobs.demo_tasks", "a task list made from the demo corpus"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    table = "".join(f"\n  {name:<11} {text}" for name, (_, text) in COMMANDS.items())
    p = ArgumentParser(prog="minilm", description=f"{__doc__}\n\ncommands:{table}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True, help="one of the commands above")
    for name in COMMANDS:
        sub.add_parser(name, add_help=False)
    name = p.parse_args(argv[:1]).command  # the command's own parser reads the rest, --help included
    module = importlib.import_module(COMMANDS[name][0])
    code = module.main(argv[1:])
    if name == "train":  # a torchrun rank of several leaves as `python -m minilm.train` does
        module.exit_process(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
