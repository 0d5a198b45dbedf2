"""Starting a private Ray on this machine: loopback only, token auth on.

Shared by the driver (``orchestrator.cluster``) and the reports' Ray Data
engine, which must not import the driver. Nothing here runs at import.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

LOOPBACK = ("127.0.0.1", "localhost")


def use_auth_mode(mode: str) -> None:
    """Set Ray's auth mode for this process and the Ray processes it starts.

    Ray caches the mode in its RayConfig when it is imported; re-initializing
    that config after changing the variable is what Ray itself does when it
    turns token auth on (ray._private.authentication.authentication_token_setup).
    Called where Ray is started or connected, never at import.
    """
    os.environ["RAY_AUTH_MODE"] = mode
    reload_auth()


def reload_auth() -> None:
    """Make this process read Ray's auth mode and token afresh (the config, then the token
    cache: Ray's own order). Ray caches the token it first loaded (RAY_AUTH_TOKEN,
    RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token); a process that started or joined one cluster and
    then starts or joins another with another token otherwise sends the old one."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


@contextmanager
def loopback_node_ip():
    """Keep a loopback node address as given while Ray starts or joins.

    ray.init rewrites a loopback ``_node_ip_address`` to the host's primary IP
    (ray-project/ray#59110); its servers then bind to every interface and a
    loopback-only cluster is unreachable. With the address kept, Ray binds the
    GCS, raylet, workers, driver and agents to 127.0.0.1.
    """
    from ray._private import services

    original = services.resolve_ip_for_localhost
    services.resolve_ip_for_localhost = lambda h: "127.0.0.1" if h in LOOPBACK else original(h)
    try:
        yield
    finally:
        services.resolve_ip_for_localhost = original


def private_temp_dir() -> tuple[str, str]:
    """(parent, temp dir) for a local Ray's session (sockets, logs, spilled objects).

    Ray makes its temp dir and the session and socket directories in it mode
    0777 (also a temp dir it is given), so any local user could reach its Unix
    sockets. The temp dir is therefore ``ray/`` inside a new mode-0700 parent:
    only this user (and root) can enter it. Kept short: Unix socket paths are
    limited to 107 bytes.
    """
    base = tempfile.gettempdir()
    if len(base) > 12 or not os.access(base, os.W_OK):  # <base>/cancelbench-ray-*/ray/session_*/sockets/...
        base = "/tmp"
    parent = tempfile.mkdtemp(prefix="cancelbench-ray-", dir=base)  # mkdtemp: mode 0700
    return parent, os.path.join(parent, "ray")


def start_local(**init_kwargs) -> None:
    """A new local Ray (never another session's cluster), on 127.0.0.1, token auth on, in a
    private 0700 temp dir, with a watchdog that ends it if this process dies without doing so."""
    import ray

    from cancelbench import signals, watchdog

    use_auth_mode("token")
    # Ray runs its workers at nice 15 (RayConfig worker_niceness) so they yield to the system;
    # for a device agent that is the measurement itself: beside any other work at nice 0 it
    # gets a few percent of a core and every cancel waits for the scheduler. The raylet reads
    # this from its environment when it starts. Records carry each agent's niceness.
    os.environ.setdefault("RAY_worker_niceness", "0")
    parent, temp_dir = private_temp_dir()
    watchdog.start(parent)  # before ray.init: a Ray that fails to start is cleaned up too, and the directory
    with loopback_node_ip():
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp_dir,
                 **init_kwargs)
    signals.reassert()  # ray.init put its C++ SIGTERM handler in place of ours
