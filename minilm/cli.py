"""The entry points' shared plumbing: one argument parser, one `error: ...` line, one Ctrl-C; a flag's spelling of
the last release (`ArgumentParser.rename`) still works, with a `note:`."""

from __future__ import annotations

import argparse
import functools
import sys

from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError  # noqa: F401  (re-exported)
from .options import DEMO_PRESET, add_config_flags, flag, load_yaml  # noqa: F401  (re-exported)
from .safety import redact


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"error: {redact(message)}", file=sys.stderr, flush=True)
    return code


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help (0 and False too), unless the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS) and "default" not in text and action.option_strings \
                and not isinstance(action, argparse._HelpAction):
            text += " (default: %(default)s)"
        return text


class ArgumentParser(argparse.ArgumentParser):
    """A bad flag is one `error: ...` line and one line pointing to --help (exit 2), not the whole usage."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        self.renamed: dict[str, str] = {}  # an old spelling -> the flag it is now
        self.after: list = []  # functions of the parsed namespace: one flag that sets others (--run-dir)

    def rename(self, new: str, *old: str) -> None:
        """`old` spellings parse as `new` (or, already flags, stay theirs), hidden from --help and noted on stderr
        when used, for one release."""
        for name in old:
            if name in self._option_string_actions:
                self._option_string_actions[name].help = argparse.SUPPRESS
            else:
                self._option_string_actions[name] = self._option_string_actions[new]
            self.renamed[name] = new

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        for name in dict.fromkeys(a.split("=", 1)[0] for a in args if a.split("=", 1)[0] in self.renamed):
            note(f"{name} is now {self.renamed[name]}")
        namespace, extras = super().parse_known_args(args, namespace)
        for apply in self.after:
            apply(namespace)
        return namespace, extras

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {redact(message)}\nsee: {self.prog} --help\n")


def note(message: str) -> None:
    print(f"note: {message} (the old spelling goes in the next release)", file=sys.stderr, flush=True)


def command(*errors: type[Exception], interrupted: str = "interrupted"):
    """A command's main(argv) -> exit code, where one of `errors` is its `error: ...` line and exit 2, and Ctrl-C,
    whatever it interrupts, the line `interrupted` and exit 130."""

    def wrap(main):
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                return main(argv)
            except errors as e:
                return fail(str(e))
            except KeyboardInterrupt:
                return fail(interrupted, EXIT_INTERRUPTED)

        return run

    return wrap
