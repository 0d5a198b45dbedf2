"""Was one side of a comparison run on a noisier host? ``diff`` (baseline vs candidate) and
``trend`` (each sweep vs the one before; the newest pair decides) compare, per side, over its
cancel trials that have the cpu columns (device_agents/cpu_account.py):

* **CPU-wait share**: of the time the engine's trial thread was runnable over its whole
  trials (references and cancels, tens of ms each: a sample of the sweep, not of a few ms
  after each cancel), the share it waited for a CPU: sum(trial_run_wait_ms) /
  sum(trial_run_cpu_ms + trial_run_wait_ms). What a busy host changes first. Where a side has
  no such column (external engines, older records), the engine process's threads between
  receipt and stop instead: sum(engine_cpu_wait_ms) / sum(engine_cpu_ms + engine_cpu_wait_ms);
  the two sides then use the same one.
* **load**: the median ``host_loadavg_1m`` (a 1-minute average: slow, so its threshold is
  wide).
* **runnable tasks**: the median ``host_procs_running`` (instantaneous, at receipt or stop).
* **steal**: sum(host_run_steal_ms) / sum(trial_run_wall_ms): CPUs taken by the hypervisor, on
  average, over the whole trials (in process); where a side has no such column, over the residues
  (sum(host_steal_ms) / sum(latency_ms)). /proc/stat counts steal in 10 ms ticks, so a span of a
  few ms reads one tick or none: one tick over 8 residues of 0.8 ms read as 1.5 CPUs stolen. Steal
  is judged only where each side's span is at least STEAL_TICKS_PER_LIMIT ticks per threshold
  (200 ms at the default 0.10: one tick moves the figure by at most half the threshold); a
  shorter one is said to be not judged.

A metric whose sides differ by more than its threshold flags the comparison, naming the side
with the higher value as the noisy one. A side without cpu columns (records before them, a
host that cannot read them) is not judged: nothing is flagged on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

COLUMNS = ["latency_ms", "engine_cpu_ms", "engine_cpu_wait_ms", "host_loadavg_1m", "host_procs_running",
           "host_steal_ms", "trial_run_cpu_ms", "trial_run_wait_ms", "trial_run_wall_ms", "host_run_steal_ms"]
STEAL_TICK_MS = 10.0  # /proc/stat counts in USER_HZ ticks, 100 a second on Linux whatever the kernel's HZ
STEAL_TICKS_PER_LIMIT = 2.0  # a side's span must hold this many ticks per threshold (one tick <= half of it)
REFUSED_EXIT = 3  # --refuse-noisy and a noisy comparison


@dataclass(frozen=True)
class NoiseSpec:
    wait_share: float = 0.10  # absolute difference of the CPU-wait shares (0.10 = 10 points)
    load: float = 2.0  # difference of the median 1-minute load averages
    procs: float = 1.5  # difference of the median runnable tasks
    steal: float = 0.10  # difference of the stolen CPUs during the residues
    refuse: bool = False  # a flagged comparison is refused (exit REFUSED_EXIT)


@dataclass(frozen=True)
class NoiseFacts:
    """One side's host facts over its cancel trials with cpu columns (None: not recorded)."""

    n: int = 0
    wait_share: float | None = None  # the trial thread's, over whole trials
    window_wait_share: float | None = None  # the engine process's, between receipt and stop
    load_1m: float | None = None
    procs_running: float | None = None
    steal: float | None = None
    steal_span_ms: float | None = None  # the span the steal is over: whole trials, else residues


def steal_span_needed_ms(limit: float) -> float:
    """The shortest span over which one steal tick moves the figure by at most half of ``limit``."""
    return STEAL_TICKS_PER_LIMIT * STEAL_TICK_MS / limit


# (attribute, what it is called, threshold attribute, how a value is shown)
METRICS = (("wait_share", "CPU-wait share", "wait_share", lambda v: f"{v:.0%}"),
           ("load_1m", "load average (1 min, median)", "load", lambda v: f"{v:.2f}"),
           ("procs_running", "runnable tasks (median)", "procs", lambda v: f"{v:g}"),
           ("steal", "stolen CPUs", "steal", lambda v: f"{v:.2f}"))


@dataclass
class NoiseCheck:
    """The two sides' facts and every metric beyond its threshold: (noisy side, text)."""

    names: tuple[str, str]
    sides: tuple[NoiseFacts, NoiseFacts]
    spec: NoiseSpec
    reasons: list[tuple[str, str]] = field(default_factory=list)
    unjudged: list[str] = field(default_factory=list)  # metrics not judged, and why

    @property
    def flagged(self) -> bool:
        return bool(self.reasons)

    @property
    def noisy(self) -> list[str]:
        """The noisy side(s), in the order of ``names``."""
        return [n for n in self.names if any(side == n for side, _ in self.reasons)]

    @property
    def refused(self) -> bool:
        return self.flagged and self.spec.refuse

    def line(self) -> str:
        """One sentence: which side was noisy and why, or that neither was."""
        aside = f" ({'; '.join(self.unjudged)})" if self.unjudged else ""
        if not self.flagged:
            judged = all(s.n for s in self.sides)
            return ("host noise: within the thresholds" + aside if judged
                    else "host noise: not judged (a side has no cpu columns)")
        said = "; ".join(f"{side} noisier: {text}" for side, text in self.reasons)
        return f"NOISY {' and '.join(self.noisy)}: {said}{aside}"

    def to_dict(self) -> dict:
        return {"flagged": self.flagged, "noisy": self.noisy, "refused": self.refused,
                "reasons": [{"side": s, "why": t} for s, t in self.reasons], "unjudged": list(self.unjudged),
                "sides": {n: s.__dict__ for n, s in zip(self.names, self.sides)},
                "thresholds": {k: v for k, v in self.spec.__dict__.items() if k != "refuse"}}


def _col(t: pa.Table, name: str) -> np.ndarray:
    if name not in t.column_names:
        return np.full(t.num_rows, np.nan)
    return t.column(name).to_numpy(zero_copy_only=False).astype(float)


def _share(cpu: np.ndarray, wait: np.ndarray) -> float | None:
    ok = np.isfinite(cpu) & np.isfinite(wait)
    runnable = float(cpu[ok].sum() + wait[ok].sum())
    return float(wait[ok].sum()) / runnable if runnable > 0 else None


def noise_of(table: pa.Table) -> NoiseFacts:
    """A side's facts over ``table``'s rows (every trial kind): the wait share over whole trials,
    the host facts over the rows with a receipt -> stop window."""
    if "engine_cpu_ms" not in table.column_names or table.num_rows == 0:
        return NoiseFacts()
    run = _share(_col(table, "trial_run_cpu_ms"), _col(table, "trial_run_wait_ms"))
    t = table.filter(pc.fill_null(pc.is_valid(table.column("engine_cpu_ms")), False))
    if t.num_rows == 0 and run is None:
        return NoiseFacts()
    median = lambda a: float(np.median(a[np.isfinite(a)])) if np.isfinite(a).any() else None  # noqa: E731
    steal, span = _steal(_col(table, "host_run_steal_ms"), _col(table, "trial_run_wall_ms"))
    if steal is None:
        steal, span = _steal(_col(t, "host_steal_ms"), _col(t, "latency_ms"))
    return NoiseFacts(n=table.num_rows, wait_share=run,
                      window_wait_share=_share(_col(t, "engine_cpu_ms"), _col(t, "engine_cpu_wait_ms")),
                      load_1m=median(_col(t, "host_loadavg_1m")), procs_running=median(_col(t, "host_procs_running")),
                      steal=steal, steal_span_ms=span)


def _steal(steal_ms: np.ndarray, span_ms: np.ndarray) -> tuple[float | None, float | None]:
    """(stolen CPUs on average, the span summed, ms) over the rows that have both; (None, None)."""
    ok = np.isfinite(steal_ms) & np.isfinite(span_ms)
    span = float(span_ms[ok].sum())
    return (float(steal_ms[ok].sum()) / span, span) if ok.any() and span > 0 else (None, None)


def compare_noise(base: NoiseFacts, cand: NoiseFacts, spec: NoiseSpec,
                  names: tuple[str, str] = ("baseline", "candidate")) -> NoiseCheck:
    check = NoiseCheck(names, (base, cand), spec)
    whole = base.wait_share is not None and cand.wait_share is not None  # else both sides' window shares
    for attr, what, limit_attr, show in METRICS:
        if attr == "wait_share" and not whole:
            attr, what = "window_wait_share", "CPU-wait share (engine threads, receipt to stop)"
        a, b, limit = getattr(base, attr), getattr(cand, attr), getattr(spec, limit_attr)
        if attr == "steal" and a is not None and b is not None and not _steal_judged(base, cand, limit, check):
            continue
        if a is None or b is None or abs(b - a) <= limit:
            continue
        noisy, quiet = (names[1], names[0]) if b > a else (names[0], names[1])
        hi, lo = max(a, b), min(a, b)
        check.reasons.append((noisy, f"{what} {show(hi)} vs {show(lo)} on the {quiet} "
                                     f"(differs by more than {f'{limit * 100:g} points' if 'wait' in attr else show(limit)})"))
    return check


def _steal_judged(base: NoiseFacts, cand: NoiseFacts, limit: float, check: NoiseCheck) -> bool:
    """Whether both sides' steal spans are long enough for their ticks; if not, the check says so."""
    need = steal_span_needed_ms(limit)
    short = min(base.steal_span_ms or 0.0, cand.steal_span_ms or 0.0)
    if short >= need:
        return True
    check.unjudged.append(f"steal not judged: a side's span is {short:.0f} ms, one {STEAL_TICK_MS:g} ms tick needs {need:.0f} ms")
    return False


def refusal_line(command: str, check: NoiseCheck) -> str:
    return (f"cancelbench {command}: refused: {check.line()}; rerun on a quieter host, or without --refuse-noisy "
            f"to compare anyway")
