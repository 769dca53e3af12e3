"""The entry points' shared plumbing: the one `error: ...` line. Only entry points import this module."""

from __future__ import annotations

import sys

from .errors import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, UsageError  # noqa: F401  (re-exported)
from .options import DEMO_PRESET, add_config_flags, flag, load_yaml  # noqa: F401  (re-exported)
from .safety import redact


def fail(message: str, code: int = EXIT_USAGE) -> int:
    print(f"error: {redact(message)}", file=sys.stderr, flush=True)
    return code
