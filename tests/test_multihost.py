"""Real multi-host topologies: `ray start` on hosts in network namespaces (tests/netns.py).

One module-scoped token-auth cluster (head + host-a + host-b, the head with its
dashboard for `ray job submit`) serves the agents, sweep, job, auth and host-cut
tests; one single-host cluster with token auth off checks attaching to a
default Ray. Drivers run inside the head's namespace, as on a head machine.
The first test checks the local (single-machine) Ray a sweep starts: every
listening socket of its processes is on loopback.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cancelbench.sink import read_manifest, read_records

import netns

_WHY_NOT = netns.netns_unavailable()
needs_netns = pytest.mark.skipif(_WHY_NOT is not None and not netns.REQUIRE,
                                 reason=f"network namespaces unavailable: {_WHY_NOT}")

SWEEP_TOML = """
[sweep]
seed = {seed}
trials_per_cell = {trials}
reference_runs = 3
mechanisms = ["abort_callback"]
deliveries = ["driver"]
[devices]
backends = ["cpu"]
hosts = ["host-a", "host-b"]
[[workload]]
name = "probe"
engine = "probe"
duration_us = {duration_us}
period_us = 1000
"""


# -- local Ray: loopback only ---------------------------------------------------------------
def _decode(hex_addr: str) -> ipaddress._BaseAddress:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1])
    return ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def _is_loopback(addr: ipaddress._BaseAddress) -> bool:
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or bool(mapped and mapped.is_loopback)


def listening_sockets() -> dict[int, tuple[ipaddress._BaseAddress, int]]:
    """inode -> (address, port) of every TCP socket in LISTEN state (this network namespace)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":  # TCP_LISTEN
                host, port = f[1].split(":")
                out[int(f[9])] = (_decode(host), int(port, 16))
    return out


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def descendants(root: int) -> list[int]:
    """Every live process below ``root`` (parent links from /proc/PID/stat)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.extend(children.get(pid, []))
        todo.extend(children.get(pid, []))
    return out


def test_local_ray_listens_on_loopback_only():
    """Every listener of the local Ray a sweep starts (GCS, raylet, agents, workers, driver) is on loopback.

    On a host with a routable address Ray rewrites a loopback node address to
    it and binds its gRPC servers to every interface; cluster.connect keeps it.
    """
    import ray

    from cancelbench.orchestrator import cluster
    from cancelbench.orchestrator.config import DeviceSelector

    assert not ray.is_initialized()
    cluster.connect(None)
    try:
        slot = cluster.discover_slots(DeviceSelector(backends=("cpu",)))[0]
        agent = cluster.start_agent(slot, n_threads=1, max_restarts=0)
        agent_pid = ray.get(agent.probe.remote())["pid"]
        me = os.getpid()
        pids = [me, *descendants(me)]
        listening = listening_sockets()
        owners: dict[str, list] = {}
        for pid in pids:
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                found = [listening[i] for i in socket_inodes(pid) if i in listening]
            except FileNotFoundError:
                continue  # exited meanwhile
            role = {me: "driver", agent_pid: "agent"}.get(pid, name)
            owners.setdefault(role, []).extend(found)
        ray.kill(agent)
    finally:
        ray.shutdown()
    # The listeners exist (the check below is not vacuous) ...
    assert {"gcs_server", "raylet", "driver", "agent"} <= set(owners), owners
    # ... and every one of them is on loopback.
    outside = {name: [f"{a}:{p}" for a, p in socks if not _is_loopback(a)] for name, socks in owners.items()}
    assert not any(outside.values()), outside


# -- the namespace cluster ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def hosts():
    if _WHY_NOT is not None:
        pytest.fail(f"CANCELBENCH_REQUIRE_NETNS=1 but network namespaces are unavailable: {_WHY_NOT}")
    c = netns.NetnsCluster([("head", "cpu"), ("host-a", "cpu"), ("host-b", "cpu_metal-0")], dashboard=True)
    c.start()
    yield c
    c.teardown()


def _agents(c: netns.NetnsCluster, *args: str, env: dict | None = None):
    return c.run(c.head, ["cancelbench", "agents", "--address", c.address, *args], env=env, timeout=300)


def _table(stdout: str) -> set[tuple[str, str]]:
    """(host, device) of each row `cancelbench agents` printed."""
    lines = stdout.strip().splitlines()
    assert lines and lines[0].split()[:4] == ["host", "platform", "backend", "device"], stdout
    return {(r.split()[0], r.split()[3]) for r in lines[1:]}


@needs_netns
def test_agents_lists_every_host_over_the_network(hosts):
    r = _agents(hosts, "--backend", "cpu", "--backend", "metal")
    assert r.returncode == 0, r.stderr[-3000:]
    # host-b declares "cpu_metal-0": the label form `ray start --labels` accepts.
    assert _table(r.stdout) == {("head", "cpu:0"), ("host-a", "cpu:0"), ("host-b", "cpu:0"), ("host-b", "metal:0")}
    assert "warning" not in r.stderr  # a token-auth cluster: no warning
    # A backend no node offers is named; the others are still listed (and only they).
    r = _agents(hosts, "--backend", "cpu", "--backend", "cuda")
    assert r.returncode == 0, r.stderr[-3000:]
    assert _table(r.stdout) == {("head", "cpu:0"), ("host-a", "cpu:0"), ("host-b", "cpu:0")}
    assert "no alive node offers cuda" in r.stderr


def _one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@needs_netns
def test_token_cluster_with_a_missing_or_wrong_token_is_one_clear_line(hosts, tmp_path):
    empty_home = tmp_path / "home"
    empty_home.mkdir()
    r = _agents(hosts, env=hosts.env(HOME=str(empty_home)))
    assert r.returncode == 2 and "no token was found" in _one_line(r.stderr) and "RAY_AUTH_TOKEN_PATH" in r.stderr
    r = _agents(hosts, env=hosts.env(RAY_AUTH_TOKEN="0" * 32))
    assert r.returncode == 2 and "rejected this machine's auth token" in _one_line(r.stderr)
    r = _agents(hosts, env=hosts.env(RAY_AUTH_MODE="disabled"))
    assert r.returncode == 2 and "requires token authentication" in _one_line(r.stderr)
    # The token file named by RAY_AUTH_TOKEN_PATH works from any HOME.
    r = _agents(hosts, "--backend", "cpu",
                env=hosts.env(HOME=str(empty_home), RAY_AUTH_TOKEN_PATH=str(hosts.home / ".ray" / "auth_token")))
    assert r.returncode == 0 and ("host-a", "cpu:0") in _table(r.stdout), r.stderr[-3000:]


def _write_toml(path: Path, **kw) -> Path:
    path.write_text(SWEEP_TOML.format(**kw))
    return path


@needs_netns
def test_cross_host_sweep_with_driver_delivery(hosts, tmp_path):
    out = tmp_path / "x"
    toml = _write_toml(tmp_path / "x.toml", seed=3, trials=6, duration_us=100_000)
    r = hosts.run(hosts.head, ["cancelbench", "sweep", "--config", str(toml), "--out", str(out),
                               "--address", hosts.address, "--quiet", "--no-summary"])
    assert r.returncode == 0, r.stderr[-3000:]
    df = read_records(out)
    assert sorted(df.host.unique()) == ["host-a", "host-b"]
    assert df.trial_id.is_unique and len(df) == 2 * (3 + 6)
    cancels = df[df.trial_kind == "cancel"]
    assert (cancels.delivery == "driver").all() and cancels.t_issued_driver_ns.notna().all()
    assert set(cancels.outcome) <= {"cancelled", "completed"} and (cancels.outcome == "cancelled").any()
    agents = read_manifest(out)["agents"]
    assert set(agents) == {"host-a/cpu:0", "host-b/cpu:0"}
    assert len({a["node_id"] for a in agents.values()}) == 2  # two nodes, not one


@needs_netns
def test_ray_job_submit_runs_a_sweep(hosts, tmp_path):
    """The README's `ray job submit --working-dir .`, from another host to the head's dashboard."""
    out = tmp_path / "job"
    toml = _write_toml(tmp_path / "job.toml", seed=4, trials=3, duration_us=50_000)
    r = hosts.run(hosts.host("host-a"), ["ray", "job", "submit", "--address", hosts.dashboard_url,
                                         "--working-dir", ".", "--", "cancelbench", "sweep", "--config", str(toml),
                                         "--out", str(out), "--quiet", "--no-summary"], timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "succeeded" in r.stdout.lower(), r.stdout[-3000:]
    df = read_records(out)
    assert sorted(df.host.unique()) == ["host-a", "host-b"] and len(df) == 2 * (3 + 3)
    # No --address: the job's driver found the cluster through RAY_ADDRESS (a local Ray has no host-a/host-b).
    assert read_manifest(out)["status"] == "complete"


def _host_rows(out: Path, host: str) -> int:
    if not (out / "records").is_dir() or not any((out / "records").rglob("*.parquet")):
        return 0
    return int((read_records(out, columns=["host"]).host == host).sum())


@needs_netns
def test_host_cut_mid_sweep_then_rejoined_and_resumed(hosts, tmp_path):
    out = tmp_path / "cut"
    toml = _write_toml(tmp_path / "cut.toml", seed=5, trials=60, duration_us=50_000)
    cmd = ["cancelbench", "sweep", "--config", str(toml), "--out", str(out), "--address", hosts.address,
           "--quiet", "--no-summary"]
    b = hosts.host("host-b")
    proc = hosts.popen(hosts.head, cmd)
    try:
        # Wait until host-b has flushed records: it is working on its trials.
        while proc.poll() is None and _host_rows(out, "host-b") == 0:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        hosts.cut(b)
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    assert "host-b/cpu:0: agent gone (host host-b left the cluster?)" in stderr, stderr[-3000:]
    plan = set(pq.read_table(out / "plan.parquet").column("trial_id").to_pylist())
    df = read_records(out)
    manifest = read_manifest(out)
    not_run = set(manifest["not_run"])
    assert manifest["status"] == "incomplete" and not_run, manifest
    assert df.trial_id.is_unique and not (set(df.trial_id) & not_run)  # nothing twice
    assert set(df.trial_id) | not_run == plan  # nothing silently missing
    a, bb = df[df.host == "host-a"], df[df.host == "host-b"]
    assert len(a) == len(plan) // 2 and a.outcome.isin(["cancelled", "completed"]).all()  # host-a finished
    assert len(bb) < len(plan) // 2 and all(t.startswith("host-b_") for t in not_run)
    assert (bb.outcome == "lost").sum() <= 1  # at most the trial in flight at the cut
    assert bb[bb.outcome != "lost"].outcome.isin(["cancelled", "completed"]).all()

    # The host comes back (a new raylet, same labels) and --resume runs what it missed.
    hosts.stop_host(b)
    hosts.reconnect(b)
    hosts.start_host(b)
    r = hosts.run(hosts.head, cmd + ["--resume"])
    df2 = read_records(out)
    lost = int((df2.outcome == "lost").sum())
    assert r.returncode == (1 if lost else 0), (lost, r.stderr[-3000:])
    assert df2.trial_id.is_unique and set(df2.trial_id) == plan  # every planned trial, exactly once
    resumed = df2[df2.trial_id.isin(not_run)]
    assert (resumed.host == "host-b").all() and resumed.outcome.isin(["cancelled", "completed"]).all()
    m2 = read_manifest(out)
    assert m2["status"] == "complete" and m2["resumed"] == 1 and not m2["not_run"]


SIM_FARM_TOML = """
[sweep]
seed = 8
trials_per_cell = 4
reference_runs = 3
mechanisms = ["abort_callback"]
deliveries = ["driver", "agent"]
[devices]
sim_per_host = {per_host}
[[workload]]
name = "sim"
engine = "sim"
sim_phase_us = 30000
sim_granularity_us = 1000
sim_steps = 2
"""


@needs_netns
def test_simulated_farm_on_three_hosts_killed_mid_sweep_then_resumed_exactly_once(hosts, tmp_path):
    """A device farm in miniature: 11 simulated devices on each of the 3 hosts (33 agents), the
    driver SIGKILLed once it has written records, then --resume: every planned trial exactly
    once, and `report` reads the dataset (saying it is simulated)."""
    out, toml = tmp_path / "farm", tmp_path / "farm.toml"
    toml.write_text(SIM_FARM_TOML.format(per_host=11))
    cmd = ["cancelbench", "sweep", "--config", str(toml), "--out", str(out), "--address", hosts.address,
           "--quiet", "--no-summary"]
    proc = hosts.popen(hosts.head, cmd)
    try:
        while not ((out / "records").is_dir() and any((out / "records").rglob("*.parquet"))):
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        proc.kill()  # the driver only (SIGKILL): its agents end with its Ray job
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    plan = set(pq.read_table(out / "plan.parquet").column("trial_id").to_pylist())
    assert len(plan) == 33 * (3 + 2 * 4)  # per device: 3 references, 4 cancels per delivery
    first = read_records(out)
    assert first.trial_id.is_unique and 0 < len(first) < len(plan)  # killed mid-sweep
    r = hosts.run(hosts.head, cmd + ["--resume"])
    df = read_records(out)
    assert r.returncode == (1 if (df.outcome == "lost").any() else 0), r.stderr[-3000:]
    assert df.trial_id.is_unique and set(df.trial_id) == plan  # every planned trial, exactly once
    assert sorted(df.host.unique()) == ["head", "host-a", "host-b"] and df.device.nunique() == 11
    assert df.outcome.isin(["cancelled", "completed", "lost"]).all() and (df.outcome == "cancelled").any()
    assert read_manifest(out)["status"] == "complete"
    rep = hosts.run(hosts.head, ["cancelbench", "report", str(out)])
    assert rep.returncode in (0, 1), rep.stderr[-3000:]  # 1: a defect line (e.g. a lost trial), still a report
    assert "SIMULATED" in rep.stdout, rep.stdout[:3000]
    assert f"{33 * 2 * 4} cancel records from 1 dataset" in rep.stdout, rep.stdout[:3000]


# -- a cluster with token auth off ----------------------------------------------------------------
@needs_netns
def test_unauthenticated_cluster_is_joined_with_a_warning(tmp_path):
    if _WHY_NOT is not None:
        pytest.fail(f"CANCELBENCH_REQUIRE_NETNS=1 but network namespaces are unavailable: {_WHY_NOT}")
    c = netns.NetnsCluster([("solo", "cpu")], auth=False).start()
    toml = tmp_path / "solo.toml"
    toml.write_text(SWEEP_TOML.format(seed=6, trials=2, duration_us=50_000).replace('"host-a", "host-b"', '"solo"'))
    sweep = ["cancelbench", "sweep", "--config", str(toml), "--address", c.address, "--quiet", "--no-summary"]
    try:
        # A sweep runs on it: agents start and trials run (a token-mode driver's actors die there).
        r = c.run(c.head, sweep + ["--out", str(tmp_path / "ok")])
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(read_records(tmp_path / "ok")) == 3 + 2 and "token authentication off" in r.stderr
        r = c.run(c.head, sweep + ["--out", str(tmp_path / "no")], env=c.env(RAY_AUTH_MODE="token"))
        assert r.returncode == 2 and "unset RAY_AUTH_MODE" in _one_line(r.stderr)
        assert not (tmp_path / "no").exists()
        r = _agents(c, "--backend", "cpu")
        assert r.returncode == 0, r.stderr[-3000:]
        assert _table(r.stdout) == {("solo", "cpu:0")}
        warning = [ln for ln in r.stderr.splitlines() if "warning" in ln]
        assert warning == [f"cancelbench: warning: the Ray cluster at {c.address} has token authentication off "
                           "(anyone who reaches it can run code on it)"], r.stderr[-3000:]
        # Asking for token auth from a cluster without it: one line saying what to change.
        r = _agents(c, env=c.env(RAY_AUTH_MODE="token"))
        assert r.returncode == 2 and "unset RAY_AUTH_MODE" in _one_line(r.stderr)
    finally:
        c.teardown()
    assert not netns.namespace_pids(c.head.ns)
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert c.head.ns not in listed  # teardown removed what it made
