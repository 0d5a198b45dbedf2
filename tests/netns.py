"""Several Ray hosts on one machine: Linux network namespaces joined by a bridge.

Each host is a network namespace with its own address in 198.18.0.0/15 (the
benchmarking range, never routed) on a veth pair; the head's namespace holds
the bridge. Ray runs there exactly as the README's cluster section says: the
venv's `ray start --head` / `ray start --address` with RAY_AUTH_MODE=token, a
token generated once with `ray get-auth-token --generate` and shared through
~/.ray/auth_token (one temporary HOME for every host, as if copied), and
`--labels` naming the host and its devices. Nothing touches this machine's own
network namespace: the veth ends are created directly inside the namespaces.
Teardown kills only the processes inside these namespaces (`ip netns pids`),
then deletes the namespaces.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = REPO / ".venv" / "bin"
NET = "198.18.7"  # a /24 inside 198.18.0.0/15
GCS_PORT = 6379
DASHBOARD_PORT = 8265
REQUIRE = os.environ.get("CANCELBENCH_REQUIRE_NETNS") == "1"

# Node death is noticed after health checks fail; shorter than Ray's default
# (~30 s) so a cut host is declared dead sooner. Tuning only, same code path.
FAST_HEALTH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
               "RAY_health_check_failure_threshold": "3"}


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (Debian package iproute2)"
    if not (VENV_BIN / "ray").exists():
        return f"no {VENV_BIN / 'ray'} (run make setup)"
    name = f"cbnt-probe-{uuid.uuid4().hex[:6]}"
    r = _ip("netns", "add", name, check=False)
    if r.returncode:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass(frozen=True)
class Host:
    label: str  # cancelbench.io/host
    backends: str  # cancelbench.io/backends label value ("" = let the node probe)
    ns: str
    ip: str
    temp_dir: Path


class NetnsCluster:
    """A head and device hosts, each in its own namespace. ``auth=False``: a default Ray (token auth off)."""

    def __init__(self, hosts: list[tuple[str, str]], auth: bool = True, dashboard: bool = False) -> None:
        tag = uuid.uuid4().hex[:6]
        # Short paths: Ray's Unix sockets live under the temp dir (108-byte limit).
        self.root = Path(tempfile.mkdtemp(prefix=f"cbnt-{tag}-", dir="/tmp"))
        self.hosts = [Host(label, backends, f"cbnt-{tag}-{i}", f"{NET}.{i + 1}", self.root / f"r{i}")
                      for i, (label, backends) in enumerate(hosts)]
        self.home = self.root / "home"
        self.auth, self.dashboard = auth, dashboard
        self._made: list[str] = []

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.ip}:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.head.ip}:{DASHBOARD_PORT}"

    def host(self, label: str) -> Host:
        return next(h for h in self.hosts if h.label == label)

    # -- running things inside a host -------------------------------------------------
    def env(self, **extra: str) -> dict:
        """An activated venv with this cluster's HOME; the pytest process's RAY_* are dropped."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "CANCELBENCH_TEST"))}
        env.update(HOME=str(self.home), VIRTUAL_ENV=str(VENV_BIN.parent), PATH=f"{VENV_BIN}:{env.get('PATH', '')}",
                   PYTHONUNBUFFERED="1")
        env["RAY_worker_niceness"] = "0"  # agents at normal priority, as a cancelbench-started Ray runs them
        if self.auth:
            env["RAY_AUTH_MODE"] = "token"
        env.update(extra)
        return env

    def cmd(self, host: Host, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", host.ns, *argv]

    def run(self, host: Host, argv: list[str], env: dict | None = None, timeout: float = 600,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(host, argv), env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout, cwd=cwd or REPO)

    def popen(self, host: Host, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        return subprocess.Popen(self.cmd(host, argv), env=env or self.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO)

    # -- topology -----------------------------------------------------------------------
    def _make_network(self) -> None:
        head = self.head
        for h in self.hosts:
            _ip("netns", "add", h.ns)
            self._made.append(h.ns)
            _ip("-n", h.ns, "link", "set", "lo", "up")
        _ip("-n", head.ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", head.ns, "addr", "add", f"{head.ip}/24", "dev", "br0")
        _ip("-n", head.ns, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts[1:], start=1):
            _ip("link", "add", f"vh{i}", "netns", head.ns, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _ip("-n", head.ns, "link", "set", f"vh{i}", "master", "br0", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.ip}/24", "dev", "eth0")
            _ip("-n", h.ns, "link", "set", "eth0", "up")
        # A default route, so Ray's own "which address am I" probe finds the host address.
        _ip("-n", head.ns, "route", "add", "default", "dev", "br0")
        for h in self.hosts[1:]:
            _ip("-n", h.ns, "route", "add", "default", "dev", "eth0")

    def _peer(self, host: Host) -> str:
        return f"vh{self.hosts.index(host)}"

    def cut(self, host: Host) -> None:
        """Take a host off the network (both ends of its link down)."""
        _ip("-n", host.ns, "link", "set", "eth0", "down")
        _ip("-n", self.head.ns, "link", "set", self._peer(host), "down")

    def reconnect(self, host: Host) -> None:
        _ip("-n", self.head.ns, "link", "set", self._peer(host), "up")
        _ip("-n", host.ns, "link", "set", "eth0", "up")

    # -- Ray ------------------------------------------------------------------------------
    def _labels(self, h: Host) -> str:
        labels = f"cancelbench.io/host={h.label}"
        return labels + (f",cancelbench.io/backends={h.backends}" if h.backends else "")

    def _ray_start(self, h: Host) -> None:
        if h is self.head:
            argv = ["ray", "start", "--head", f"--node-ip-address={h.ip}", f"--port={GCS_PORT}"]
            argv += ([f"--dashboard-host={h.ip}", f"--dashboard-port={DASHBOARD_PORT}"] if self.dashboard
                     else ["--include-dashboard=false"])
        else:
            argv = ["ray", "start", f"--address={self.address}", f"--node-ip-address={h.ip}"]
        argv += [f"--labels={self._labels(h)}", "--num-cpus=1", f"--temp-dir={h.temp_dir}", "--disable-usage-stats"]
        r = self.run(h, argv, env=self.env(**FAST_HEALTH), timeout=300)
        if r.returncode:
            raise RuntimeError(f"ray start on {h.label} failed: {r.stderr[-3000:]}")

    def start_host(self, h: Host) -> None:
        """(Re)start Ray on a device host and wait until the head sees it alive."""
        self._ray_start(h)
        self.wait_alive()

    def stop_host(self, h: Host) -> None:
        """Kill every process inside the host's namespace (its raylet, agents, workers)."""
        _kill_namespace(h.ns)

    def wait_alive(self, timeout_s: float = 300) -> None:
        """Wait until every host's node is alive in the GCS (asked from inside the head)."""
        script = (
            "import sys, time, ray\n"
            f"ray.init(address='{self.address}', log_to_driver=False)\n"
            f"want = {sorted(h.label for h in self.hosts)!r}\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            "while time.monotonic() < deadline:\n"
            "    alive = sorted(n['Labels'].get('cancelbench.io/host', '') for n in ray.nodes() if n['Alive'])\n"
            "    if alive == want: sys.exit(0)\n"
            "    time.sleep(0.5)\n"
            "sys.exit(f'nodes alive: {alive}, wanted {want}')\n")
        r = self.run(self.head, ["python", "-c", script], timeout=timeout_s + 120)
        if r.returncode:
            raise RuntimeError(f"cluster not ready: {r.stderr[-3000:]}")

    def start(self) -> "NetnsCluster":
        try:
            self._make_network()
            self.home.mkdir()
            if self.auth:
                r = self.run(self.head, ["ray", "get-auth-token", "--generate"], timeout=120)
                assert r.returncode == 0 and (self.home / ".ray" / "auth_token").exists(), r.stderr
            for h in self.hosts:
                self._ray_start(h)
            self.wait_alive()
        except BaseException:
            self.teardown()
            raise
        return self

    def teardown(self) -> None:
        for ns in reversed(self._made):
            _kill_namespace(ns)
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        shutil.rmtree(self.root, ignore_errors=True)


def namespace_pids(ns: str) -> list[int]:
    r = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in r.stdout.split()] if r.returncode == 0 else []


def _kill_namespace(ns: str, grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL, every process in the namespace; only ours live there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in namespace_pids(ns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while namespace_pids(ns) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not namespace_pids(ns):
            return
