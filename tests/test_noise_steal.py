"""The noise check's steal (reports/noise.py) on tables built here: over whole trials where the
records have them, over residues otherwise, and judged only over a span long enough for
/proc/stat's 10 ms ticks (a CI runner read one tick over 8 residues of 0.8 ms as 1.5 CPUs stolen,
and flagged one half of one idle sweep against the other)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from cancelbench.reports.noise import NoiseSpec, compare_noise, noise_of, steal_span_needed_ms


def side(n: int, *, latency_ms: float, steal_ms: list[float], run_wall_ms: float | None = None,
         run_steal_ms: list[float] | None = None) -> pa.Table:
    """``n`` cancelled trials: residue ``latency_ms`` with ``steal_ms`` each (host_steal_ms), and
    when given, whole trials of ``run_wall_ms`` with ``run_steal_ms``."""
    cols = {"latency_ms": [latency_ms] * n, "engine_cpu_ms": [latency_ms / 2] * n,
            "engine_cpu_wait_ms": [0.0] * n, "host_loadavg_1m": [0.5] * n, "host_procs_running": [2] * n,
            "host_steal_ms": steal_ms, "trial_run_cpu_ms": [1.0] * n, "trial_run_wait_ms": [0.0] * n}
    if run_wall_ms is not None:
        cols |= {"trial_run_wall_ms": [run_wall_ms] * n, "host_run_steal_ms": run_steal_ms}
    return pa.table(cols)


def test_one_tick_over_short_residues_is_not_judged():
    """What the CI runner saw: one side's 8 residues of 0.8 ms held one 10 ms tick (1.56 CPUs),
    the other's none. Older records (no whole-trial columns): steal over the residues, 6.4 ms,
    under the 200 ms one tick needs at the default threshold: not judged, and the line says so."""
    ticked = noise_of(side(8, latency_ms=0.8, steal_ms=[10.0] + [0.0] * 7))
    quiet = noise_of(side(8, latency_ms=0.8, steal_ms=[0.0] * 8))
    assert ticked.steal == pytest.approx(10.0 / 6.4) and ticked.steal_span_ms == pytest.approx(6.4)
    check = compare_noise(quiet, ticked, NoiseSpec())
    assert not check.flagged and check.unjudged and "steal not judged" in check.line()
    assert "6 ms" in check.unjudged[0] and "200 ms" in check.unjudged[0]
    assert check.to_dict()["unjudged"] == check.unjudged


def test_whole_trials_are_read_first_and_judged():
    """With the whole-trial columns, steal is theirs (the residues' tick is not read): 8 trials of
    50 ms (400 ms) with 80 ms stolen is 0.2 CPUs against none, beyond 0.10: flagged."""
    stolen = noise_of(side(8, latency_ms=0.8, steal_ms=[0.0] * 8, run_wall_ms=50.0, run_steal_ms=[10.0] * 8))
    quiet = noise_of(side(8, latency_ms=0.8, steal_ms=[10.0] + [0.0] * 7, run_wall_ms=50.0,
                          run_steal_ms=[0.0] * 8))
    assert stolen.steal == pytest.approx(0.2) and stolen.steal_span_ms == pytest.approx(400.0)
    assert quiet.steal == 0.0  # the residue's tick is not what it reads
    check = compare_noise(quiet, stolen, NoiseSpec())
    assert check.noisy == ["candidate"] and not check.unjudged
    assert "stolen CPUs 0.20 vs 0.00 on the baseline" in check.line()


def test_the_span_needed_follows_the_threshold():
    """One tick moves the figure by at most half the threshold: 200 ms at 0.10, 2 s at 0.01; a
    side just under it is not judged, one at it is."""
    assert steal_span_needed_ms(0.10) == pytest.approx(200.0) and steal_span_needed_ms(0.01) == pytest.approx(2000.0)
    short = noise_of(side(4, latency_ms=1.0, steal_ms=[0.0] * 4, run_wall_ms=49.0, run_steal_ms=[20.0] * 4))
    enough = noise_of(side(4, latency_ms=1.0, steal_ms=[0.0] * 4, run_wall_ms=50.0, run_steal_ms=[0.0] * 4))
    assert compare_noise(enough, short, NoiseSpec()).unjudged  # 196 ms
    longer = noise_of(side(4, latency_ms=1.0, steal_ms=[0.0] * 4, run_wall_ms=50.0, run_steal_ms=[20.0] * 4))
    check = compare_noise(enough, longer, NoiseSpec())
    assert not check.unjudged and check.noisy == ["candidate"]  # 200 ms: 0.40 vs 0.00
