"""Every use of Ray's private internals (checked against `CHECKED_RAY_VERSION`), in one place: each is reached at
call time and does nothing, returning False, when it has moved, so the run behaves as plain Ray does."""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable
from types import ModuleType

CHECKED_RAY_VERSION = "2.60.0"
# Ray Train's controller polls its workers' reports every this many seconds (2 by default); read from the
# environment of the process that calls fit(). Not a documented setting: see bench.overhead --mode report.
CONTROLLER_POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
# Set by Ray's job supervisor for the entrypoint of `ray job submit` only (ray/dashboard/modules/job/job_supervisor.py)
JOB_DRIVER_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
DRAIN_FALLBACK_EVERY = 50  # steps between the barrier calls of drain_announced's fallback (the same on every rank)

_TOKEN_SETUP = "ray._private.authentication.authentication_token_setup"
_TRAIN_CONTEXT = "ray.train.v2._internal.execution.context"
_RAY_WORKER = "ray._private.worker"
_RAY_LOGGING = "ray._private.ray_logging"


def _internal(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def quiet_token_auth_notice() -> bool:
    """Ray turns token auth on for a new local cluster and says so at WARNING: nothing for the user to do."""
    module = _internal(_TOKEN_SETUP)
    if module is None:
        return False
    logging.getLogger(module.__name__).setLevel(logging.ERROR)
    return True


def quiet_train_report_logs() -> bool:
    """Ray Train logs every `ray.train.report` as a screen-wide dump, on a logger named after its file, which
    `LoggingConfig(log_level=...)` misses; our own log line says what matters."""
    module = _internal(_TRAIN_CONTEXT)
    if module is None or not getattr(module, "__file__", None):
        return False
    logging.getLogger(module.__file__).setLevel(logging.WARNING)
    return True


def route_worker_output(handle: Callable[[dict], None], take_raylet: Callable[[dict], bool]) -> bool:
    """In this driver, hand the worker output Ray would print (`ray_print_logs`) to `handle` instead, and offer each
    raylet message to `take_raylet` first (it returns True when it took the message; Ray prints the others)."""
    ray_worker, ray_logging = _internal(_RAY_WORKER), _internal(_RAY_LOGGING)
    dispatcher = getattr(ray_logging, "global_worker_stdstream_dispatcher", None)
    ray_print = getattr(ray_worker, "print_to_stdstream", None)
    if dispatcher is None or ray_print is None or "ray_print_logs" not in [n for n, _ in getattr(dispatcher, "handlers", [])]:
        return False
    dispatcher.remove_handler("ray_print_logs")
    dispatcher.add_handler("minilm_console", handle)

    # The raylet's messages reach the driver through print_to_stdstream, looked up at call time.
    def print_raylet(data: dict, ignore_prefix: bool) -> None:
        if not take_raylet(data):
            ray_print(data, ignore_prefix)

    ray_worker.print_to_stdstream = print_raylet
    return True


def defer_sigterm_exit(on_sigterm: Callable[[], None]) -> bool:
    """Let the first SIGTERM only call `on_sigterm`, so the loop checkpoints at a step boundary; a second
    one exits as Ray would (Ray's handler exits through a function looked up at call time)."""
    ray_worker = _internal(_RAY_WORKER)
    original = getattr(ray_worker, "raise_sys_exit_with_custom_error_message", None)
    if original is None:
        return False
    seen = []

    def deferred(message, exit_code=1, *args, **kwargs):
        if "SIGTERM" in str(message) and not seen:
            seen.append(time.time())
            on_sigterm()
            return
        return original(message, exit_code, *args, **kwargs)

    ray_worker.raise_sys_exit_with_custom_error_message = deferred
    return True


def drain_announced(call: int) -> bool:
    """Has Ray announced a drain of a node hosting this worker group? Reading Ray Train's mark is local;
    the fallback, `ray.train.get_preemption_info()`, is a barrier, so it runs every DRAIN_FALLBACK_EVERY-th call."""
    module = _internal(_TRAIN_CONTEXT)
    try:
        return module.get_train_context().preemption_context.preemption_info is not None
    except AttributeError:
        import ray.train

        return call % DRAIN_FALLBACK_EVERY == 0 and ray.train.get_preemption_info() is not None
