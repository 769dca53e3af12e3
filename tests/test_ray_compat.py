"""ray_jobs.ray_compat: each use of a Ray internal works against the installed Ray, and falls back to plain Ray's
behaviour when the internal is taken away (its module made unimportable, or the name removed). No Ray starts."""

from __future__ import annotations

import importlib
import logging
import sys
from types import SimpleNamespace

import pytest
import ray
import ray.train

from ray_jobs import ray_compat


def remove_module(monkeypatch, name: str) -> None:
    """`importlib.import_module(name)` raises ImportError from now until the test ends."""
    monkeypatch.setitem(sys.modules, name, None)


def test_the_checked_version_is_the_installed_one():
    assert ray.__version__ == ray_compat.CHECKED_RAY_VERSION


@pytest.mark.parametrize("function, module, level", [
    (ray_compat.quiet_token_auth_notice, ray_compat._TOKEN_SETUP, logging.ERROR),
    (ray_compat.quiet_train_report_logs, ray_compat._TRAIN_CONTEXT, logging.WARNING),
])
def test_a_logger_is_quieted_and_a_moved_one_is_left_alone(monkeypatch, function, module, level):
    found = importlib.import_module(module)
    logger = logging.getLogger(found.__file__ if module == ray_compat._TRAIN_CONTEXT else found.__name__)
    monkeypatch.setattr(logger, "level", logging.NOTSET)
    assert function() is True and logger.level == level
    logger.setLevel(logging.NOTSET)
    remove_module(monkeypatch, module)
    assert function() is False and logger.level == logging.NOTSET


def test_the_first_sigterm_is_deferred_and_the_second_exits(monkeypatch):
    ray_worker = importlib.import_module(ray_compat._RAY_WORKER)
    exits, flags = [], []
    monkeypatch.setattr(ray_worker, "raise_sys_exit_with_custom_error_message",
                        lambda message, exit_code=1: exits.append((message, exit_code)))
    assert ray_compat.defer_sigterm_exit(lambda: flags.append(True)) is True
    ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", 1)
    assert flags == [True] and exits == []
    ray_worker.raise_sys_exit_with_custom_error_message("The process receives a SIGTERM.", 1)
    assert flags == [True] and exits == [("The process receives a SIGTERM.", 1)]


def test_without_rays_exit_function_sigterm_is_left_to_ray(monkeypatch):
    ray_worker = importlib.import_module(ray_compat._RAY_WORKER)
    monkeypatch.delattr(ray_worker, "raise_sys_exit_with_custom_error_message")
    assert ray_compat.defer_sigterm_exit(lambda: None) is False
    assert not hasattr(ray_worker, "raise_sys_exit_with_custom_error_message")
    remove_module(monkeypatch, ray_compat._RAY_WORKER)
    assert ray_compat.defer_sigterm_exit(lambda: None) is False


def test_a_drain_is_read_from_the_train_context(monkeypatch):
    context = importlib.import_module(ray_compat._TRAIN_CONTEXT)
    info = SimpleNamespace(preemption_info=None)
    monkeypatch.setattr(context, "get_train_context", lambda: SimpleNamespace(preemption_context=info))
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: pytest.fail("the barrier must not be called"))
    assert ray_compat.drain_announced(1) is False
    info.preemption_info = object()
    assert ray_compat.drain_announced(2) is True


def test_without_the_train_context_a_drain_is_asked_every_50th_step(monkeypatch):
    remove_module(monkeypatch, ray_compat._TRAIN_CONTEXT)
    asked = []
    monkeypatch.setattr(ray.train, "get_preemption_info", lambda: asked.append(1) or object())
    every = ray_compat.DRAIN_FALLBACK_EVERY
    assert [ray_compat.drain_announced(call) for call in range(1, 2 * every + 1)] == \
        [call % every == 0 for call in range(1, 2 * every + 1)]
    assert len(asked) == 2


class Dispatcher:
    def __init__(self, names):
        self.handlers = [(name, print) for name in names]

    def remove_handler(self, name):
        self.handlers = [h for h in self.handlers if h[0] != name]

    def add_handler(self, name, handler):
        self.handlers.append((name, handler))


def test_worker_output_is_routed_and_other_raylet_messages_still_printed(monkeypatch):
    ray_worker = importlib.import_module(ray_compat._RAY_WORKER)
    ray_logging = importlib.import_module(ray_compat._RAY_LOGGING)
    dispatcher, printed = Dispatcher(["ray_print_logs"]), []
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", dispatcher)
    monkeypatch.setattr(ray_worker, "print_to_stdstream", lambda data, ignore_prefix: printed.append(data))
    handle = object()
    assert ray_compat.route_worker_output(handle, lambda data: data.get("routine", False)) is True
    assert dispatcher.handlers == [("minilm_console", handle)]
    ray_worker.print_to_stdstream({"routine": True}, False)
    ray_worker.print_to_stdstream({"routine": False}, False)
    assert printed == [{"routine": False}]


def test_without_rays_dispatcher_worker_output_is_left_to_ray(monkeypatch):
    ray_worker = importlib.import_module(ray_compat._RAY_WORKER)
    ray_logging = importlib.import_module(ray_compat._RAY_LOGGING)
    original = ray_worker.print_to_stdstream
    dispatcher = Dispatcher([])  # Ray's own handler under another name: nothing to replace
    monkeypatch.setattr(ray_logging, "global_worker_stdstream_dispatcher", dispatcher)
    assert ray_compat.route_worker_output(print, lambda data: True) is False
    assert dispatcher.handlers == [] and ray_worker.print_to_stdstream is original
    remove_module(monkeypatch, ray_compat._RAY_LOGGING)
    assert ray_compat.route_worker_output(print, lambda data: True) is False
    assert ray_worker.print_to_stdstream is original
