"""Checkpoints, one owner: `manager` (when, staging, writing, publishing, pruning, loading), `files` (the folder on
disk, its marker, exports), `resume` (the run folder, its lease, which checkpoint a run continues), `best` (the best checkpoint by an eval metric,
and the checkpoints pruning keeps for it)."""

from . import best, files, resume  # noqa: F401
from .best import *  # noqa: F403
from .files import *  # noqa: F403
from .manager import *  # noqa: F403
from .resume import *  # noqa: F403
