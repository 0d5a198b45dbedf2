"""Residue split and noise-aware comparison on real sweeps (issue 26, items 2 and 3).

Real sweeps of one build (the text fixture in process, one thread, cancels aimed into prefill):
one on the host as it is, of twice the trials, dealt alternately into two datasets (the idle
pair: whatever else the host starts or stops meanwhile, both sides share it, trial by trial, so
diff has nothing to flag between them), and one beside busy loops (``python3 -c 'while 1: pass'``:
twice the tasks the idle sweep found runnable, at least two per CPU this test may use, so
four on the quiet 2-core CI host) that the test starts, waits on until each has observably run
on a CPU, and stops. Then the real command: ``cancelbench
diff`` flags the busy candidate as noisy (and refuses it with --refuse-noisy, exit 3; JUnit and
GitHub outputs say so) and the idle pair not; ``trend`` flags its newest (busy) sweep; the
report shows the split, checked per trial against the record's own reads and stamps.

What the busy loops change is unmistakable whatever else the host runs: with the runnable
tasks doubled, the engine thread's CPU-wait share rises by 20 points or more (the threshold is
10) and the runnable tasks by at least two per CPU (the threshold is 1.5).

Steal is the hypervisor's, not the test's: a CI runner's vCPUs were taken 1.5 CPUs' worth in
part of one idle sweep and not the rest. The comparisons whose flagged side these tests assert
take steal out (``NO_STEAL``); tests/test_noise_steal.py judges steal on tables it builds, and
here the sweeps' own steal columns are checked to be what the comparison reads.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.compute as pc
import pytest

from cancelbench.cli import main as cli_main
from cancelbench.fileio import write_json_atomic
from cancelbench.orchestrator.config import load_config
from cancelbench.orchestrator.runner import run_sweep
from cancelbench.reports.residue import split_frame
from cancelbench.sink import MANIFEST, RecordSink, open_dataset, read_manifest, read_records

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="schedstat is Linux's")

TRIALS = 8  # cancel trials a side
NO_STEAL = ["--noise-steal", "1000"]  # steal can differ between any two sweeps here: not the test's to provoke
CONFIG = f"""
[sweep]
seed = 5
trials_per_cell = {TRIALS}
reference_runs = 3
mechanisms = ["abort_callback"]
deliveries = ["agent"]
ping_samples = 3
[offsets]
plan = "progress"
phases = ["prefill"]
[[workload]]
name = "text"
engine = "text"
model = "fixture:text-qwen3-14m"
n_threads = 1
prompt_tokens = 64
max_tokens = 2
n_batch = 8
"""


def _ran_ns(pid: int) -> int:
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0])


def loops_for(idle_runnable: float) -> int:
    """How many busy loops make the busy sweep unmistakable on this host: twice what the idle
    sweeps found runnable (their median ``host_procs_running``, the engine's threads and whatever
    else the host runs included), at least two per CPU this process may use. On a host already
    busy (a CI runner building beside the tests: 7-8 runnable on 2 CPUs), two loops moved the
    engine thread's CPU-wait share by 6 points, under the 10-point threshold; doubling the
    runnable tasks moves it by 20 or more, whatever the host ran before."""
    cpus = len(os.sched_getaffinity(0))
    return min(64, max(2 * cpus, math.ceil(2 * idle_runnable)))


@contextmanager
def busy_loops(n: int):
    """``n`` ``while 1: pass`` processes, each waited on until it has run 50 ms on a CPU (its own
    schedstat, not a sleep); killed and reaped on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(n)]
    try:
        for p in procs:
            while _ran_ns(p.pid) < 50_000_000:
                assert p.poll() is None, "a busy loop exited"
                os.sched_yield()
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
    assert all(p.returncode == -9 for p in procs)  # they ran until killed: busy the whole sweep


def split_alternately(src: Path, sides: tuple[Path, Path]) -> None:
    """One sweep's dataset as two: its cancel trials dealt alternately by plan position
    (``trial_index``), so both sides ran through the same host conditions, trial by trial; each
    side keeps every reference run and its own sweep id (two datasets to the reports)."""
    table = open_dataset(src).to_table()
    manifest = read_manifest(src)
    cancels = sorted(r["trial_index"] for r in table.filter(pc.equal(table["trial_kind"], "cancel"))
                     .select(["trial_index"]).to_pylist())
    side_of = {index: k % 2 for k, index in enumerate(cancels)}
    for k, out in enumerate(sides):
        sweep_id = f"{manifest['sweep_id']}-{'ab'[k]}"
        rows = [{**r, "sweep_id": sweep_id} for r in table.to_pylist()
                if r["trial_kind"] != "cancel" or side_of[r["trial_index"]] == k]
        sink = RecordSink(out, flush_every=10**9)
        for r in rows:
            sink.add(r)
        sink.close()
        write_json_atomic(out / MANIFEST, {**manifest, "sweep_id": sweep_id, "planned_trials": len(rows)})


@pytest.fixture(scope="module")
def sweeps(local_ray, tmp_path_factory) -> dict[str, Path]:
    """idle_a and idle_b: one sweep of twice the trials on the host as it is, split alternately
    (whatever else starts or stops on the host meanwhile, both sides share it); busy: one
    sweep beside the busy loops."""
    root = tmp_path_factory.mktemp("noise")
    (root / "sweep.toml").write_text(CONFIG)
    (root / "idle.toml").write_text(CONFIG.replace(f"trials_per_cell = {TRIALS}", f"trials_per_cell = {2 * TRIALS}"))
    run_sweep(load_config(root / "idle.toml"), root / "idle", progress=False)
    out = {"idle_a": root / "idle_a", "idle_b": root / "idle_b"}
    split_alternately(root / "idle", (out["idle_a"], out["idle_b"]))
    idle = read_records(root / "idle")
    assert (idle.trial_kind == "cancel").sum() == 2 * TRIALS
    with busy_loops(loops_for(float(idle.host_procs_running.median()))):
        run_sweep(load_config(root / "sweep.toml"), root / "busy", progress=False)
    out["busy"] = root / "busy"
    return out


def test_the_idle_sides_alternate_through_one_sweep(sweeps):
    """The two idle datasets are the one sweep's trials dealt in turn: as many cancels each, in
    alternating plan positions, interleaved in time, with every reference run on both."""
    a, b = (read_records(sweeps[k]) for k in ("idle_a", "idle_b"))
    ca, cb = (d[d.trial_kind == "cancel"] for d in (a, b))
    assert len(ca) == len(cb) == TRIALS and not set(ca.trial_id) & set(cb.trial_id)
    order = pd.concat([ca.assign(side="a"), cb.assign(side="b")]).sort_values("trial_index")
    assert (order.side.to_numpy()[::2] == "a").all() and (order.side.to_numpy()[1::2] == "b").all()
    assert ca.t_handback_ns.min() < cb.t_handback_ns.max() and cb.t_handback_ns.min() < ca.t_handback_ns.max()
    refs = [set(d[d.trial_kind == "reference"].trial_id) for d in (a, b)]
    assert refs[0] == refs[1] and len(refs[0]) > 0
    assert {*a.sweep_id} != {*b.sweep_id} and len({*a.sweep_id}) == 1 == len({*b.sweep_id})


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = cli_main(argv)
    except SystemExit as exc:  # argparse's own errors
        rc = exc.code
    got = capsys.readouterr()
    return rc, got.out, got.err


def _raw_cancelled(path: Path) -> pd.DataFrame:
    """The cancelled trials of a dataset that have the trial thread's reads, by trial id, with the
    residue from the raw agent-clock stamps (not the derived ``latency_ms``)."""
    df = read_records(path)
    c = df[(df.trial_kind == "cancel") & (df.outcome == "cancelled") & df.trial_cpu_ms.notna()].set_index("trial_id")
    return c.assign(stamped_ms=(c.t_terminal_ns - c.t_received_ns) / 1e6)


def test_the_split_adds_up_per_trial_and_the_report_shows_it(sweeps, capsys):
    """The report's per-trial split (``split_frame``, what its cells summarize) against the record's
    own measurements: each part within what was measured, none negative, the three adding up to the
    residue as the agent's stamps give it, and the measurements kept whole where they fit in it."""
    fits_seen = 0
    for path in sweeps.values():
        raw = _raw_cancelled(path)
        everyone = read_records(path)
        assert len(raw) > 0 and len(raw) == ((everyone.trial_kind == "cancel") & (everyone.outcome == "cancelled")).sum()
        got = split_frame(open_dataset(path).to_table(), extra=("trial_id",)).set_index("trial_id")
        assert sorted(got.index) == sorted(raw.index)  # every such trial split, once
        got = got.loc[raw.index]
        cpu, wait_raw, wall = raw.trial_cpu_ms, raw.trial_cpu_wait_ms.fillna(0.0), raw.stamped_ms
        assert (raw.stamped_ms > 0).all() and (raw.cpu_window_ms > 0).all()
        # >= 0, not > 0: under a hypervisor's steal a thread's CPU clock (the kernel's clock_task)
        # stands still while its vCPU is taken, and a CI runner read 0 over one trial's residue
        assert (got.work >= 0).all() and (got.work > 0).any() and (got.wait >= 0).all() and (got.rest >= 0).all()
        assert (got.work <= cpu + 1e-9).all() and (got.wait <= wait_raw + 1e-9).all()
        assert np.allclose(got.work + got.wait + got.rest, wall, atol=1e-6, rtol=0)
        assert np.allclose(got.wall, wall, atol=1e-6, rtol=0)
        # what fits in the residue is kept whole: the CPU read where it fits (one thread's CPU time
        # over the residue: nearly always), the wait read where both fit (a loaded host's wait in
        # progress at the receipt is read whole, and may not)
        fits = cpu <= wall
        assert np.allclose(got.work[fits], cpu[fits], atol=1e-9, rtol=0)
        both = cpu + wait_raw <= wall
        assert np.allclose(got.wait[both], wait_raw[both], atol=1e-9, rtol=0)
        fits_seen += int(fits.sum())
    assert fits_seen > 0  # the uncapped case was checked, not only the caps
    busy = _raw_cancelled(sweeps["busy"])
    assert (busy.trial_cpu_wait_ms.dropna() > 0).any()  # the loops took the engine thread's CPU at times
    rc, out, _ = _cli(["report", str(sweeps["busy"]), "--format", "json"], capsys)
    cells = json.loads(out)["residue"]
    assert cells and {c["phase"] for c in cells} == {"prefill"}
    assert sum(c["n"] for c in cells) == len(busy)
    for c in cells:
        rows = busy[busy.phase_at_receipt == c["phase"]]
        assert c["n"] == len(rows) and c["wall_max"] == pytest.approx(rows.stamped_ms.max(), abs=1e-6)
        assert c["work_share"] + c["wait_share"] + c["rest_share"] == pytest.approx(1.0)
        assert min(c["work_share"], c["wait_share"], c["rest_share"]) >= 0
        # no more engine work or CPU wait than the reads measured, of the summed residue
        assert c["work_share"] <= rows.trial_cpu_ms.sum() / rows.stamped_ms.sum() + 1e-9
        assert c["wait_share"] <= rows.trial_cpu_wait_ms.fillna(0.0).sum() / rows.stamped_ms.sum() + 1e-9
    _, text, _ = _cli(["report", str(sweeps["busy"])], capsys)
    assert "== Residue split per phase at receipt ==" in text


def test_diff_flags_the_busy_candidate_as_noisy(sweeps, tmp_path, capsys):
    junit = tmp_path / "diff.xml"
    rc, out, err = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["busy"]), "--format", "json",
                         "--junit", str(junit), *NO_STEAL], capsys)
    noise = json.loads(out)["noise"]
    assert noise["flagged"] and noise["noisy"] == ["candidate"], noise
    assert rc in (0, 1) and err == ""  # flagged, not refused: the verdict stands, saying so
    assert noise["sides"]["candidate"]["wait_share"] > noise["sides"]["baseline"]["wait_share"]
    xml = junit.read_text()
    assert 'name="baseline vs candidate"' in xml and 'type="noisy"' in xml and "NOISY candidate" in xml
    _, text, _ = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["busy"]), *NO_STEAL], capsys)
    assert text.splitlines()[1].startswith(("verdict: OK, NOISY candidate", "verdict: REGRESSED, NOISY candidate"))
    _, annotations, _ = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["busy"]), "--format", "github", *NO_STEAL],
                             capsys)
    assert annotations.startswith("::error title=cancelbench diff%3A host noise%3A baseline vs candidate::NOISY candidate: ")
    # the other way round, the baseline is the noisy side
    _, out, _ = _cli(["diff", str(sweeps["busy"]), str(sweeps["idle_a"]), "--format", "json", *NO_STEAL], capsys)
    assert json.loads(out)["noise"]["noisy"] == ["baseline"]


def test_refuse_noisy_refuses_with_one_line_and_exit_3(sweeps, tmp_path, capsys):
    junit = tmp_path / "refused.xml"
    rc, _, err = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["busy"]), "--refuse-noisy", "--junit", str(junit),
                       *NO_STEAL], capsys)
    assert rc == 3
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("cancelbench diff: refused: NOISY candidate: candidate noisier")
    assert 'type="refused"' in junit.read_text()


def test_idle_vs_idle_is_not_flagged(sweeps, capsys):
    rc, out, err = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["idle_b"]), "--format", "json",
                         "--refuse-noisy", *NO_STEAL], capsys)
    noise = json.loads(out)["noise"]
    assert not noise["flagged"] and noise["noisy"] == [] and rc != 3 and err == "", noise
    assert all(noise["sides"][s]["n"] > 0 for s in ("baseline", "candidate"))  # judged, not skipped


def test_steal_is_read_over_whole_trials(sweeps, capsys):
    """Each side's steal is over its whole trials (every kind): the sum of the records' own
    host_run_steal_ms (whole /proc/stat ticks) over the sum of their trial_run_wall_ms, a span
    long enough to judge here; the residue columns are not what it reads."""
    _, out, _ = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["busy"]), "--format", "json"], capsys)
    sides = json.loads(out)["noise"]["sides"]
    for side, key in (("baseline", "idle_a"), ("candidate", "busy")):
        df = read_records(sweeps[key])
        df = df[df.trial_kind.isin(["cancel", "reference"])]
        assert df.trial_run_wall_ms.notna().all() and (df.trial_run_wall_ms > 0).all()
        # one thread has no more CPU than wall time; each reading takes the clock first, then the CPU
        # clock, so the CPU delta may exceed the wall's by the CPU time spent between the end's reads
        assert (df.trial_run_wall_ms >= df.trial_run_cpu_ms - 0.2).all()
        steal = df.host_run_steal_ms
        assert steal.notna().all() and (steal >= 0).all() and np.allclose(steal % 10.0, 0.0)
        assert sides[side]["steal_span_ms"] == pytest.approx(df.trial_run_wall_ms.sum())
        assert sides[side]["steal"] == pytest.approx(steal.sum() / df.trial_run_wall_ms.sum())


def test_trend_flags_its_busy_newest_sweep(sweeps, capsys):
    dirs = [str(sweeps[k]) for k in ("idle_a", "idle_b", "busy")]
    rc, out, _ = _cli(["trend", *dirs, "--by", "given", "--format", "json", *NO_STEAL], capsys)
    noise = json.loads(out)["noise"]
    assert noise[0] is None and not noise[1]["flagged"] and noise[2]["noisy"] == ["sweep 3"], noise
    rc, _, err = _cli(["trend", *dirs, "--by", "given", "--refuse-noisy", *NO_STEAL], capsys)
    assert rc == 3 and err.startswith("cancelbench trend: refused: NOISY sweep 3")


def test_noise_thresholds_are_checked_options(sweeps, capsys):
    rc, _, err = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["busy"]), "--noise-wait-share", "1.5"], capsys)
    assert rc == 2 and err.startswith("cancelbench diff: error: argument --noise-wait-share")
    # thresholds wide enough for anything: the busy candidate is no longer flagged
    rc, out, _ = _cli(["diff", str(sweeps["idle_a"]), str(sweeps["busy"]), "--format", "json", "--noise-wait-share",
                       "0.99", "--noise-procs", "1000", "--noise-load", "1000", "--noise-steal", "1000"], capsys)
    assert not json.loads(out)["noise"]["flagged"]
