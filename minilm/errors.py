"""The leaf of the house: the exit codes and the one usage-error class every layer raises. Imports nothing of minilm."""

from __future__ import annotations

EXIT_USAGE = 2  # bad flag, bad config, bad data: nothing was started
EXIT_FAILED = 1  # training (or a Ray task) started and failed
EXIT_INTERRUPTED = 130  # Ctrl-C / SIGTERM of the driver


class UsageError(Exception):
    """A mistake on the command line, in a config file or in the inputs: `error: ...`, exit 2 (and, when
    given, one `hint: ...` line saying what to do)."""

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.hint = hint
