"""Checkpoints, one owner: `manager` (when and how), `files` (the folder on disk), `resume` (the run folder and
which checkpoint a run continues), `best` (the best checkpoint and what pruning keeps)."""

from .best import *  # noqa: F403
from .files import *  # noqa: F403
from .manager import *  # noqa: F403
from .resume import *  # noqa: F403
