"""Command-line plumbing of the Ray entrypoints: the local Ray, printable URIs (the rest is `minilm.cli`'s)."""

from __future__ import annotations

import os

from minilm.cli import DEMO_PRESET, UsageError, fail, load_yaml  # noqa: F401  (re-exported)
from minilm.safety import redact

from .ray_compat import quiet_token_auth_notice

redact_uri = redact  # the old name: minilm.safety.redact is the one redaction


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity), which Ray's logical CPUs may overstate."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def connect_failure(address: str, error: BaseException) -> str:
    """One line for a cluster that could not be joined (Ray raises ConnectionError from its own chain)."""
    chain, e = [], error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    import ray.exceptions

    # Ray 2.60 puts the AuthenticationError into a RuntimeError's text ("Last connection error: ..."), not its chain
    if any(isinstance(x, ray.exceptions.AuthenticationError) or "InvalidAuthToken" in str(x) for x in chain):
        why = ("it refused this process's authentication token (the cluster has token authentication on): set "
               "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN to the cluster's token (or RAY_AUTH_TOKEN_PATH to its file)")
    else:
        why = f"nothing answered there; is the cluster up (`ray status --address {address}`)?"
    return f"cannot join the Ray cluster at RAY_ADDRESS={address}: {why}"


def ensure_ray(num_cpus: int | None = None, *, quiet: bool = True) -> bool:
    """Connect to the cluster in RAY_ADDRESS (ray job submit sets it) or start a local Ray; True when this call
    started a local Ray (its machine is all the run has).

    A local Ray gets more logical CPUs than cores: training workers that take every CPU would
    starve the Ray Data tasks that feed them (a 2-core Ray with 2 workers never starts reading).
    """
    import ray
    import ray.exceptions

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        try:
            ray.init(address=address, log_to_driver=True, logging_level="WARNING" if quiet else "INFO")
        except (ConnectionError, ray.exceptions.AuthenticationError) as e:
            raise UsageError(connect_failure(address, e)) from None
        return False
    cores = os.cpu_count() or 2
    quiet_token_auth_notice()  # Ray says it turned token auth on: nothing for the user to do
    # address="local": a new Ray even when another one runs on this machine (join a cluster via RAY_ADDRESS).
    ray.init(address="local", num_cpus=num_cpus or max(8, 2 * cores), log_to_driver=True, include_dashboard=None,
             logging_level="WARNING" if quiet else "INFO")
    return True

