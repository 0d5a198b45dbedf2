"""Test helpers (importable as `helpers` from test modules)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

from cancelbench import native


class RecordingServer:
    """The server side a :class:`cancelbench.sut.trial.Trial` writes to, with no pipe: the engine
    library's own rules tested without a process. ``sent``: each message the trial wrote, with
    whether it had taken its terminal decision then."""

    def __init__(self, mechanism: str = "between_calls") -> None:
        from cancelbench.sut.declaration import Declaration, MechanismInfo, Phase

        self.declaration = Declaration(name="e", version="1", input="text", phases=(Phase("prefill", True),),
                                       mechanisms=(MechanismInfo(mechanism, ""),), settings=())
        self.word = None
        self.sent: list[tuple[dict, bool]] = []
        self.trial = None

    def run(self, trial_id: str = "t1", t_read: int = 1):
        """A new trial of this server's mechanism, as a ``run`` read at ``t_read`` makes one."""
        from cancelbench.sut.trial import Trial

        msg = {"trial": trial_id, "mechanism": self.declaration.mechanism_names[0], "input": "x"}
        self.trial = Trial(self, msg, t_read)
        return self.trial

    def send(self, msg: dict) -> None:
        self.sent.append((msg, self.trial._closed))


def cancel_inside_call(ctl, call_name: str | None = None, when: Callable = lambda progress: True) -> dict:
    """Land the cancel inside the first native call named ``call_name`` (any call if None)
    that starts while ``when(ctl.progress)`` holds.

    The engine's own ``ctl.native_call`` context marks a call in flight; this wraps it on
    this one control so the cancel is received on the engine's thread right after the call
    is marked and before it runs: where it lands is decided by construction, the same on an
    idle or a loaded host (no polling thread, no timing). Returns ``{"call": name}`` once landed.
    """
    original = ctl.native_call
    landed: dict = {}

    @contextmanager
    def native_call(name: str):
        with original(name):
            if not landed and call_name in (None, name) and when(ctl.progress):
                landed["call"] = name
                ctl.request(native.now_ns())
            yield

    ctl.native_call = native_call
    return landed


def cancel_at_first_step(engine, trial_id: str, *, wait_s: float = 60.0):
    """One agent-delivered cancel trial of an engine the agent drives (its ``run(request, ctl)``, no Ray):
    the cancel taken by the agent's control once the engine's first step event is read (inside its first
    step: a wait of the sim engine), not at a time. The result and the record's columns."""
    import threading

    from cancelbench.device_agents.engines.base import CancelControl, Progress
    from cancelbench.request import TrialRequest

    ctl = CancelControl(native.CancelToken(), Progress())
    entered = threading.Event()
    ctl.progress.listener = lambda event, phase, t: entered.set() if event == "step" else None

    def cancel_in_the_step() -> None:
        if entered.wait(wait_s):
            ctl.request(native.now_ns())
    threading.Thread(target=cancel_in_the_step, daemon=True).start()
    result = engine.run(TrialRequest("abort_callback", "", trial_id=trial_id, trial_kind="cancel",
                                     delivery="agent"), ctl)
    return result, engine.trial_columns()


def cancel_when(ctl, predicate: Callable) -> dict:
    """Land the cancel inside the first native call that starts while ``predicate(ctl.progress)`` holds."""
    return cancel_inside_call(ctl, None, predicate)


def rss_kb() -> int:
    """This process's resident set, in KiB (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4


# A leak grows the resident set on (nearly) every cycle; a one-time growth does not:
# a compute buffer reserved larger for a graph of a new size, or a malloc arena made for
# a new thread, steps the resident set up once and it stays flat after. A least-squares
# slope reads one such step as a leak (CI saw one step of ~7 MB mid-run read as 455 KiB
# per cycle), so the few largest steps are set aside and the rest averaged.
ONE_TIME_STEPS = 3
LEAK_BOUND_KB_PER_CYCLE = 256  # the engines' stated bound: < 256 KiB per cancel/run cycle


def leak_kb_per_cycle(rss: list[int], warmup: int = 5, one_time_steps: int = ONE_TIME_STEPS) -> float:
    """Mean resident-set growth per cycle after ``warmup`` cycles, leaving out the
    ``one_time_steps`` largest growths."""
    tail = rss[warmup:]
    steps = sorted(b - a for a, b in zip(tail, tail[1:]))
    kept = steps[: len(steps) - one_time_steps]
    if not kept:
        raise ValueError(f"need more than {warmup + one_time_steps + 1} cycles, got {len(rss)}")
    return sum(kept) / len(kept)


def probe_sweep(trials: int, duration_us: int = 20_000, names: tuple[str, ...] = ("probe",)) -> str:
    """A sweep TOML of the known-answer probe engine: immediate cancels, agent delivery,
    one mechanism; small and quick, for tests of the sweep's bookkeeping (exactly once,
    signals, a full disk), not of an engine."""
    return f"""
[sweep]
trials_per_cell = {trials}
mechanisms = ["abort_callback"]
deliveries = ["agent"]
ping_samples = 3
[offsets]
plan = "immediate"
""" + "".join(f"""[[workload]]
name = "{name}"
engine = "probe"
duration_us = {duration_us}
period_us = 1000
""" for name in names)
