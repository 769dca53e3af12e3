"""Fault-injection suite (docs/reliability.md). A package, so its test modules may share basenames with tests/."""
