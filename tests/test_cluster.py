"""Multi-node sweeps on a real ray.cluster_utils.Cluster, all nodes on 127.0.0.1.

Nodes are labelled as device hosts: a CPU host, a Vulkan host (lavapipe) and a
host that claims Metal (this machine cannot run Metal: its agent must report
the device missing, and a sweep that asks for it must fail before any trial).
"""

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster

from cancelbench.device_agents.backends import which_wheel_variant
from cancelbench.orchestrator import cluster as cl
from cancelbench.orchestrator.clock import estimate_offset
from cancelbench.orchestrator.config import DeviceSelector, OffsetSpec, SweepConfig, WorkloadSpec
from cancelbench.orchestrator.runner import SweepInputError, run_sweep
from cancelbench.raylocal import reload_auth
from cancelbench.sink import read_manifest, read_records

CPU_TEXT = WorkloadSpec(name="text-small", model="fixture:text-llama-57m", prompt_tokens=64, max_tokens=4,
                        n_batch=64, n_ubatch=64, chunk_tokens=16, backends=("cpu",))
# Lavapipe is ~30x slower than the CPU backend: the Vulkan workload is smaller.
VK_TEXT = WorkloadSpec(name="text-vk", model="fixture:text-qwen3-14m", prompt_tokens=64, max_tokens=2,
                       n_batch=64, n_ubatch=64, chunk_tokens=16, backends=("vulkan",))

HAVE_VULKAN = which_wheel_variant() == "vulkan"
REQUIRE_VULKAN = os.environ.get("CANCELBENCH_REQUIRE_VULKAN") == "1"


def node_args(host: str, backends: str) -> dict:
    return {"num_cpus": 1, "node_ip_address": "127.0.0.1",
            "labels": {cl.HOST_LABEL: host, cl.BACKENDS_LABEL: backends}}


@pytest.fixture(scope="module")
def ray_cluster():
    if ray.is_initialized():
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(24))  # token auth stays on
    reload_auth()  # an earlier module's local Ray left its token cached in this process
    c = Cluster(initialize_head=True, head_node_args={**node_args("cpu-host", "cpu"), "include_dashboard": False})
    c.add_node(**node_args("vulkan-host", "cpu,vulkan:0"))
    c.add_node(**node_args("mac-host", "metal:0"))
    c.wait_for_nodes()
    cl.connect(c.address)  # binds the driver to 127.0.0.1 too
    assert all(n["NodeManagerAddress"] == "127.0.0.1" for n in ray.nodes())
    yield c
    ray.shutdown()
    c.shutdown()


def config(**kw) -> SweepConfig:
    base = dict(seed=5, trials_per_cell=2, reference_runs=3, workloads=(CPU_TEXT,), ping_samples=5,
                mechanisms=("abort_callback",), deliveries=("agent",),
                devices=DeviceSelector(backends=("cpu",), hosts=("cpu-host",)))
    base.update(kw)
    return SweepConfig(**base)


def test_discovery_and_placement(ray_cluster):
    slots = cl.discover_slots(DeviceSelector(backends=("cpu", "vulkan", "metal", "cuda")[:3]))
    keys = [s.key for s in slots]
    assert keys == ["cpu-host/cpu:0", "mac-host/metal:0", "vulkan-host/cpu:0", "vulkan-host/vulkan:0"]
    assert next(s for s in slots if s.key == "vulkan-host/vulkan:0").env["GGML_VK_VISIBLE_DEVICES"] == "0"
    agents = [cl.start_agent(s, n_threads=1, max_restarts=0) for s in slots]
    try:
        probes = ray.get([a.probe.remote() for a in agents])
    finally:
        for a in agents:
            ray.kill(a)
    for slot, probe in zip(slots, probes):
        assert probe["node_id"] == slot.node_id, f"{slot.key} not on its node"
        assert probe["device"] == slot.device_id
    by_key = dict(zip(keys, probes))
    assert by_key["cpu-host/cpu:0"]["device_present"]
    assert not by_key["mac-host/metal:0"]["device_present"]  # claimed by a label, absent in this build
    assert "cpu:0" in by_key["mac-host/metal:0"]["devices_seen"]
    with pytest.raises(cl.ClusterError, match="mac-host/metal:0"):
        cl.check_agents(slots, probes)


def _agent_rows(out: str) -> set[tuple[str, str]]:
    lines = out.strip().splitlines()
    assert lines[0].split()[:4] == ["host", "platform", "backend", "device"], out
    return {(r.split()[0], r.split()[3]) for r in lines[1:]}


def test_agents_command_lists_devices(ray_cluster, capsys):
    from cancelbench.cli import main

    assert main(["agents", "--backend", "cpu"]) == 0
    assert _agent_rows(capsys.readouterr().out) == {("cpu-host", "cpu:0"), ("vulkan-host", "cpu:0")}


def test_agents_command_keeps_the_backend_filter_when_one_is_missing(ray_cluster, capsys):
    """No node offers cuda: the other requested backends are listed, and only they."""
    from cancelbench.cli import main

    assert main(["agents", "--backend", "cpu", "--backend", "cuda"]) == 0
    captured = capsys.readouterr()
    assert _agent_rows(captured.out) == {("cpu-host", "cpu:0"), ("vulkan-host", "cpu:0")}  # no metal, no vulkan
    assert "no alive node offers cuda" in captured.err


def test_agents_command_rejects_an_unknown_backend_before_ray(capsys):
    from cancelbench.cli import main

    was_up = ray.is_initialized()
    assert main(["agents", "--backend", "cpu", "--backend", "tpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown backend(s) tpu" in err[0]
    assert ray.is_initialized() == was_up  # refused before connecting


def test_missing_backend_is_an_error_before_any_trial(ray_cluster, tmp_path):
    with pytest.raises(SweepInputError, match="cuda"):
        run_sweep(config(devices=DeviceSelector(backends=("cuda",))), tmp_path / "a", progress=False)
    with pytest.raises(SweepInputError, match="mac-host/metal:0"):
        run_sweep(config(devices=DeviceSelector(backends=("metal",))), tmp_path / "b", progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_clock_offset_estimate_recovers_an_injected_skew(ray_cluster):
    skew = 7_250_000_000
    slot = next(s for s in cl.discover_slots(DeviceSelector(backends=("cpu",))) if s.host == "cpu-host")
    slot = cl.DeviceSlot(slot.node_id, slot.host, slot.device_id,
                         env={**slot.env, "CANCELBENCH_TEST_CLOCK_SKEW_NS": str(skew)})
    agent = cl.start_agent(slot, n_threads=1, max_restarts=0)
    try:
        est = estimate_offset(lambda: ray.get(agent.ping.remote()), samples=30)
    finally:
        ray.kill(agent)
    # Same host, same monotonic clock: the only offset is the injected one.
    assert abs(est.offset_ns - skew) <= est.uncertainty_ns + 1_000_000
    assert est.uncertainty_ns == (est.rtt_ns + 1) // 2


def test_phase_plan_aims_at_every_phase(ray_cluster, tmp_path):
    # Aimed early in each phase (a fifth of its shortest stay): in a suite run under two busy
    # loops the references once took 2.8 s where the cancel trials after them took 0.2 s (other
    # work on the host while they ran), and no cancel aimed anywhere in a 0.7 s "shortest"
    # prefill landed before the trial's 0.1 s prefill had ended.
    cfg = config(offsets=OffsetSpec(plan="phase", min_per_phase=4, max_fraction=0.2), mechanisms=("between_calls",),
                 trials_per_cell=1, deliveries=("driver", "agent"))
    run_sweep(cfg, tmp_path / "ph", progress=False)
    df = read_records(tmp_path / "ph")
    c = df[df.trial_kind == "cancel"]
    assert c.groupby("delivery").target_phase.value_counts().to_dict() == {
        (d, p): 4 for d in ("driver", "agent") for p in ("prefill", "generate")}
    hit = c[c.phase_at_receipt == c.target_phase]
    assert set(hit.phase_at_receipt) == {"prefill", "generate"}  # each phase actually hit
    # every cancel says whether its delivery could reach the target in time, from measured reach
    assert (c.target_window_ms > 0).all() and (c.delivery_reach_ms > 0).all()
    assert c.target_reachable.eq(c.target_window_ms - c.offset_target_ms > c.delivery_reach_ms).all()
    # the driver timed the cancel path from each reference's phase entries: prefill, entered at
    # the trial's start, is caught (the first question is answered from the run's start)
    probes = df[df.trial_kind == "reference"].round_trip_probes_ms_json.map(json.loads)
    assert len(probes) == 3 and all("prefill" in p and set(p) <= {"prefill", "generate"} for p in probes)
    assert all(ms > 0 for p in probes for trips in p.values() for ms in trips)


@pytest.mark.skipif(not HAVE_VULKAN and not REQUIRE_VULKAN,
                    reason="installed llama-cpp-python has no Vulkan backend (make test builds it on Linux/apt)")
def test_sweep_across_cpu_and_vulkan_agents(ray_cluster, tmp_path):
    assert HAVE_VULKAN, "CANCELBENCH_REQUIRE_VULKAN=1 but the installed llama-cpp-python has no Vulkan backend"
    cfg = config(workloads=(CPU_TEXT, VK_TEXT), mechanisms=("abort_callback", "chunked", "graph_eval"),
                 trials_per_cell=3,
                 devices=DeviceSelector(backends=("cpu", "vulkan"), hosts=("vulkan-host",)),
                 offsets=OffsetSpec(plan="phase", min_per_phase=3))
    run_sweep(cfg, tmp_path / "cv", progress=False)
    df = read_records(tmp_path / "cv")
    assert set(df.backend) == {"cpu", "vulkan"}  # one dataset, both backends
    assert set(df[df.backend == "vulkan"].workload) == {"text-vk"}
    assert df[df.backend == "vulkan"].device_name.str.contains("llvmpipe|lavapipe", case=False).all()
    c = df[(df.trial_kind == "cancel") & (df.outcome == "cancelled")]
    cpu_abort = c[(c.backend == "cpu") & (c.mechanism == "abort_callback") & (c.phase_at_receipt == "prefill")]
    vk_abort = c[(c.backend == "vulkan") & (c.mechanism == "abort_callback") & (c.phase_at_receipt == "prefill")]
    assert (cpu_abort.decode_rc == 2).any(), "CPU: the abort callback stops llama_decode mid-graph"
    assert len(vk_abort) > 0, "no Vulkan abort_callback cancel was received during prefill"
    # Vulkan: the callback is not honoured inside the device graph, the decode runs out.
    assert (vk_abort.decode_rc != 2).all()
    # graph_eval stops a Vulkan decode in flight: the eval reader, asked between node
    # ranges on the device, saw the cancel inside llama_decode.
    vk_graph = c[(c.backend == "vulkan") & (c.mechanism == "graph_eval") & (c.native_call_at_receipt == "llama_decode")]
    assert len(vk_graph) > 0, "no Vulkan graph_eval cancel was received during a decode"
    assert vk_graph.t_native_observed_ns.notna().any()
    seen = vk_graph.dropna(subset=["t_native_observed_ns"])
    assert (seen.t_native_observed_ns >= seen.t_received_ns).all()
    assert set(c.backend) == {"cpu", "vulkan"}  # cancels honoured on both backends


def _agent_pid(prefix: str) -> tuple[int, object] | None:
    for name in ray.util.list_named_actors():
        if name.endswith(prefix):
            actor = ray.get_actor(name)
            status = ray.get(actor.status.remote())
            if status.get("trial_id"):
                return ray.get(actor.probe.remote())["pid"], actor
    return None


def test_agent_killed_mid_trial_is_lost_once_and_the_sweep_goes_on(ray_cluster, tmp_path):
    out = tmp_path / "kill"
    cfg = config(mechanisms=("between_calls",), trials_per_cell=6, offsets=OffsetSpec(plan="uniform"))
    result = {}
    th = threading.Thread(target=lambda: result.update(r=run_sweep(cfg, out, progress=False)), daemon=True)
    th.start()
    killed = None
    deadline = time.monotonic() + 120
    while killed is None and time.monotonic() < deadline and th.is_alive():
        try:
            found = _agent_pid("/cpu-host/cpu:0")
        except Exception:
            found = None
        if found:
            os.kill(found[0], signal.SIGKILL)
            killed = found[0]
        time.sleep(0.05)
    th.join(timeout=300)
    assert killed, "never caught the agent inside a trial"
    df = read_records(out)
    lost = df[df.outcome == "lost"]
    assert len(lost) == 1
    assert lost.device.iloc[0] == "cpu:0" and lost.error.iloc[0].startswith("agent died")
    assert df.trial_id.is_unique  # nothing counted twice
    assert len(df) == result["r"].planned  # the restarted agent ran every remaining trial
    assert result["r"].exit_code == 1  # a lost trial is a failure to report


def _rows_of(out, host: str | None = None) -> int:
    """Records flushed to disk so far (of one host)."""
    if not out.joinpath("records").is_dir() or not any(out.joinpath("records").rglob("*.parquet")):
        return 0
    hosts = read_records(out, columns=["host"]).host
    return int(len(hosts) if host is None else (hosts == host).sum())


def test_node_removed_mid_sweep_reports_not_run(ray_cluster, tmp_path):
    node = ray_cluster.add_node(**node_args("spare-host", "cpu"))
    ray_cluster.wait_for_nodes()
    out = tmp_path / "rm"
    cfg = config(mechanisms=("between_calls",), trials_per_cell=20,
                 devices=DeviceSelector(backends=("cpu",), hosts=("cpu-host", "spare-host")))
    result = {}
    th = threading.Thread(target=lambda: result.update(r=run_sweep(cfg, out, progress=False)), daemon=True)
    th.start()
    # Remove the node once it has records on disk: it is working through its trials.
    while th.is_alive() and _rows_of(out, "spare-host") == 0:
        time.sleep(0.1)
    assert th.is_alive(), "the sweep ended before spare-host's first records were flushed"
    ray_cluster.remove_node(node)
    th.join(timeout=400)
    r = result["r"]
    df = read_records(out)
    assert r.not_run, "spare-host had no work left when its node was removed"
    assert r.exit_code == 1  # trials that never ran are a failure
    assert all(t.startswith("spare-host") for t in r.not_run)
    manifest = read_manifest(out)
    assert manifest["status"] == "incomplete" and sorted(manifest["not_run"]) == sorted(r.not_run)
    assert (df[df.host == "cpu-host"].outcome.isin(["cancelled", "completed"])).all()
    assert len(df[df.host == "cpu-host"]) == r.planned // 2  # the other device finished
    assert df.trial_id.is_unique and not set(r.not_run) & set(df.trial_id)


def test_driver_killed_then_resumed_runs_each_trial_exactly_once(ray_cluster, tmp_path):
    out = tmp_path / "drv"
    cfg_file = tmp_path / "sweep.toml"
    cfg_file.write_text("""
[sweep]
seed = 3
trials_per_cell = 20
mechanisms = ["between_calls", "chunked"]
deliveries = ["driver"]
[devices]
backends = ["cpu"]
hosts = ["cpu-host"]
[[workload]]
name = "text-small"
model = "fixture:text-llama-57m"
prompt_tokens = 64
max_tokens = 4
n_batch = 64
n_ubatch = 64
""")
    cmd = [sys.executable, "-m", "cancelbench.cli", "sweep", "--config", str(cfg_file), "--out", str(out),
           "--address", ray_cluster.address, "--quiet", "--no-summary"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    planned = 2 * 3 + 2 * 20
    # Kill the driver right after its first flush: records on disk, most trials still to run.
    while proc.poll() is None and _rows_of(out) == 0:
        time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    partial = read_records(out)
    assert 0 < len(partial) < planned
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=600)
    df = read_records(out)
    failures = int(df.outcome.isin(["dropped", "lost", "error"]).sum())
    assert r.returncode == (1 if failures else 0), r.stderr[-2000:]  # the same verdict `report` gives
    assert df.trial_id.is_unique
    assert len(df) == planned  # every planned trial, exactly once
    assert set(partial.trial_id) <= set(df.trial_id)
    assert read_manifest(out)["resumed"] == 1
