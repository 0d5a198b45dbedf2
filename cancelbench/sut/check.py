"""``cancelbench sut-check -- COMMAND ARGS...``: the conformance run a team uses on its
own engine before a sweep (docs/sut-protocol.md, "Checking an engine").

Each check is one function over one running engine process; every check prints one
line. The engine is started once (a check that breaks it ends the run: the checks
after it fail with the reason), so the whole run takes seconds on a small model.
"""

from __future__ import annotations

import json
import queue
import subprocess
from dataclasses import dataclass, field

from . import check_optional
from .check_optional import Check
from .client import EngineError, EngineProcess, end_leftovers, group_alive, in_trial
from .declaration import Declaration, SettingError
from .protocol import AUDIO_OUT, TRIAL_EVENTS

EXIT_OK, EXIT_FAILURES, EXIT_INPUT = 0, 1, 2  # the command's exit codes (cancelbench.cli)
EVENT_TIMEOUT_S = 60.0  # a run that says nothing for this long fails its check (a hung engine)


class CheckInputError(ValueError):
    """Bad options for sut-check (exit 2)."""


@dataclass
class Run:
    """One run as the engine reported it, and what the checker saw of it (its own clock)."""

    trial: str
    events: list[dict] = field(default_factory=list)  # phase/step/cancel_seen, in order
    done: dict | None = None
    problems: list[str] = field(default_factory=list)  # protocol breaches seen on the way
    kind: str = "cancel"  # reference | cancel
    t_cancel_sent: int | None = None  # the checker wrote the cancel
    t_done_read: int | None = None
    reach_ns: int | None = None
    stall_ns: int | None = None  # how long the cancel was held off a CPU (EngineProcess.stall_ns)
    t_run: int = 0  # the checker wrote the run

    @property
    def phases(self) -> list[str]:
        return [e["phase"] for e in self.events if e["type"] == "phase"]

    def reach_with_stall_ms(self) -> float:
        """The time the outcome rule allows the cancel (reach + stall), as the verdict lines say it."""
        return ((self.reach_ns or 0) + (self.stall_ns or 0)) / 1e6

    def done_after_cancel_ms(self) -> float:
        return (self.t_done_read - self.t_cancel_sent) / 1e6

    def outcome(self, clock) -> tuple[str, str | None]:
        """The sweep's outcome rule (cancelbench.schema.classify_outcome) on what the checker saw."""
        from cancelbench.schema import classify_outcome

        d = self.done
        received = d.get("cancel_received_t")
        return classify_outcome({
            "outcome": d["outcome"] if d["outcome"] in ("completed", "cancelled") else "error",
            "trial_kind": self.kind, "t_received_ns": self.t_cancel_sent, "t_cancel_forwarded_ns": self.t_cancel_sent,
            "t_engine_done_read_ns": self.t_done_read, "cancel_reach_ns": self.reach_ns, "cancel_stall_ns": self.stall_ns,
            "t_terminal_ns": clock.to_agent(d["t"]),
            "t_engine_received_ns": None if received is None else clock.to_agent(received)})


class Checker:
    def __init__(self, proc: EngineProcess, models: dict, given: dict, text: str, mechanism: str | None) -> None:
        self.proc, self.models, self.given, self.text, self.mechanism = proc, models, given, text, mechanism
        self.decl: Declaration | None = None
        self.settings: dict = {}
        self._n = 0
        self.runs: list[Run] = []  # every run so far (the cpu check reads their done.cpu)

    def _trial(self, what: str) -> str:
        self._n += 1
        return f"sut-check.{self._n:03d}.{what}"

    def _input(self) -> str:
        return "" if self.decl.input == "none" else self.text

    def run(self, trial: str, *, cancel_at=None, cancel_first: bool = False, kind: str = "cancel",
            word_only: bool = False) -> Run:
        """Run ``trial``; ``cancel_at(event) -> bool`` says at which event to send its cancel. Each cancel
        and the run line are followed by a ping: the round trips answered during the run are the cancel's
        reach (EngineProcess.reach_ns), as in a sweep. ``word_only``: the cancel is the shared cancel word
        alone, never the line."""
        proc, run = self.proc, Run(trial, kind=kind)
        seq = proc.next_seq()  # as a sweep: the shared cancel word first when the engine declares it

        def send_cancel() -> None:
            if word_only:
                run.t_cancel_sent = proc.word.store(seq)
            else:
                run.t_cancel_sent = proc.send_cancel(trial, seq)

        if cancel_first:
            send_cancel()
        msg = {"type": "run", "trial": trial, "mechanism": self.mechanism, "input": self._input(),
               "settings": self.settings, "output_path": None}
        if seq is not None:
            msg["cancel_seq"] = seq
        t_run = run.t_run = proc.send_timed(msg)
        self.runs.append(run)
        sent_cancel = cancel_first
        last = t_run
        while run.done is None:
            try:
                got = proc.messages.get(timeout=EVENT_TIMEOUT_S)
            except queue.Empty:
                raise EngineError(f"the engine said nothing for {EVENT_TIMEOUT_S:g} s during run {trial}") from None
            msg = proc.check(got, f"the done of {trial}").msg
            if msg["type"] == "pong":
                proc.took_pong(msg, got.t_read_ns)
                continue
            if msg["type"] not in TRIAL_EVENTS or msg.get("trial") != trial:
                run.problems.append(f"a {msg['type']} message for {msg.get('trial')!r} during run {trial}")
                continue
            t = in_trial(proc.clock, msg["t"], t_run, got.t_read_ns, last)
            if t is None:
                run.problems.append(f"{msg['type']} timestamp {msg['t']} is outside the run on the pongs' clock")
                t = proc.clock.to_agent(msg["t"])
            last = max(last, t)
            if msg["type"] == "audio" and not self.decl.can(AUDIO_OUT):
                run.problems.append(f"audio in run {trial}, from an engine that does not declare {AUDIO_OUT}")
            if msg["type"] == "done":
                run.done, run.t_done_read = msg, got.t_read_ns
                run.reach_ns, run.stall_ns = proc.reach_ns(), proc.stall_ns()
                proc.end_run()
                if msg["phase"] not in self.decl.phase_names:
                    run.problems.append(f"done says phase {msg['phase']!r}, which is not declared")
            else:
                run.events.append(msg)
                if not sent_cancel and cancel_at is not None and cancel_at(msg):
                    send_cancel()
                    sent_cancel = True
        return run

    # -- the checks, in order ------------------------------------------------
    def hello(self) -> Check:
        self.decl = self.proc.start()
        d = self.decl
        if self.mechanism is None:
            self.mechanism = d.mechanism_names[0]
        elif self.mechanism not in d.mechanism_names:
            raise CheckInputError(f"--mechanism {self.mechanism}: the engine declares {', '.join(d.mechanism_names)}")
        try:
            self.settings = d.resolve(self.given, "--setting")
        except SettingError as exc:
            raise CheckInputError(str(exc)) from None
        return Check("hello", True, f"{d.name} {d.version}, protocol {d.protocol}, phases {', '.join(d.phase_names)}, "
                                    f"mechanisms {', '.join(d.mechanism_names)}")

    def clock(self) -> Check:
        c = self.proc.clock
        if c.same:
            return Check("clock", True, f"pongs on the agent's clock ({self.decl.clock})")
        return Check("clock", True, f"another clock than the agent's: offset {c.offset_ns} ns +- "
                                    f"{c.uncertainty_ns} ns estimated (declared {self.decl.clock})")

    def load(self) -> Check:
        effective = self.proc.load(self.models, self.settings)
        return Check("load", True, f"settings {json.dumps({**self.settings, **effective}, sort_keys=True)[:300]}")

    def reference(self) -> list[Check]:
        run = self.run(self._trial("reference"), kind="reference")
        done, phases = run.done, run.phases
        out = []
        first = list(dict.fromkeys(phases))
        declared = list(self.decl.phase_names)
        problems = list(run.problems)
        outcome, why = run.outcome(self.proc.clock)
        if why is not None:
            problems.append(why)
        elif done["outcome"] != "completed":
            problems.append(f"the run ended {done['outcome']}: {done.get('error') or ''}".strip())
        if not run.events or run.events[0]["type"] != "phase":
            problems.append("the first event of a run must be a phase event")
        unknown = [p for p in first if p not in declared]
        missing = [p for p in declared if p not in first]
        if unknown:
            problems.append(f"undeclared phase(s) {', '.join(unknown)}")
        if missing:
            problems.append(f"declared phase(s) never entered: {', '.join(missing)}")
        if [p for p in declared if p in first] != [p for p in first if p in declared]:
            problems.append(f"phases first entered in the order {', '.join(first)}, declared {', '.join(declared)}")
        out.append(Check("phases", not problems, "; ".join(problems) or f"entered {' -> '.join(first)}"))
        out.append(self._steps(run))
        if self.decl.can(AUDIO_OUT):
            out.append(check_optional.audio(self.proc.loaded, run))
        return out

    def _steps(self, run: Run) -> Check:
        problems, open_step, counts, current = [], None, {}, None
        stepping = set(self.decl.step_phases)
        for e in run.events:
            if e["type"] == "phase":
                if open_step is not None:
                    problems.append(f"phase {e['phase']} entered inside a step of {open_step}")
                current = e["phase"]
            elif e["type"] == "step":
                if e["phase"] != current:
                    problems.append(f"a step of {e['phase']} while in phase {current}")
                if e["phase"] not in stepping:
                    problems.append(f"a step in {e['phase']}, declared without steps")
                if e["edge"] == "start":
                    if open_step is not None:
                        problems.append(f"a step started inside another ({e['phase']})")
                    open_step = e["phase"]
                    counts[e["phase"]] = counts.get(e["phase"], 0) + 1
                else:
                    if open_step is None:
                        problems.append(f"a step of {e['phase']} ended without a start")
                    open_step = None
        if open_step is not None:
            problems.append(f"a step of {open_step} never ended")
        silent = [p for p in self.decl.step_phases if not counts.get(p)]
        if silent:
            problems.append(f"no step in phase(s) declared with steps: {', '.join(silent)}")
        detail = ", ".join(f"{p} {n}" for p, n in counts.items())
        return Check("steps", not problems, "; ".join(dict.fromkeys(problems)) or f"paired: {detail}")

    def cancel_before_run(self) -> Check:
        run = self.run(self._trial("latched"), cancel_first=True)
        d = run.done
        outcome, _ = run.outcome(self.proc.clock)
        if outcome == "error":
            return Check("cancel_before_run", False, f"the run with a cancel sent before it ended error: "
                         f"{d.get('error') or 'no message'}")
        if outcome != "cancelled":
            return Check("cancel_before_run", False, f"a cancel sent before the run was not latched: the run "
                         f"ended {d['outcome']}, {run.done_after_cancel_ms():.1f} ms after the cancel was sent "
                         f"(a dropped cancel)")
        if "cancel_received_t" not in d:
            return Check("cancel_before_run", False, "cancelled, but done has no cancel_received_t")
        return Check("cancel_before_run", not run.problems, "; ".join(run.problems) or "latched: the run ended "
                     f"cancelled after {sum(e['type'] == 'step' for e in run.events) // 2} step(s)")

    def cancel_in_phases(self) -> list[Check]:
        out, stopped = [], 0
        for phase in self.decl.phase_names:
            run = self.run(self._trial(f"in-{phase}"),
                           cancel_at=lambda e, p=phase: e["type"] == "phase" and e["phase"] == p)
            d, name = run.done, f"cancel_in_{phase}"
            outcome, _ = run.outcome(self.proc.clock)
            if phase not in run.phases:
                out.append(Check(name, False, f"the run never entered {phase}"))
            elif outcome == "cancelled":
                stopped += 1
                ok = "cancel_received_t" in d and not run.problems
                out.append(Check(name, ok, "; ".join(run.problems) or ("stopped in " + d["phase"] if ok else
                                 "cancelled, but done has no cancel_received_t")))
            elif outcome == "dropped":
                said = "it read the cancel" if "cancel_received_t" in d else "it did not say it read the cancel"
                out.append(Check(name, False, f"the cancel sent in {phase} was dropped: the run completed "
                                 f"{run.done_after_cancel_ms():.1f} ms after the cancel was sent, past the "
                                 f"{run.reach_with_stall_ms():.2f} ms it takes to reach the engine ({said})"))
            elif outcome == "completed":
                out.append(Check(name, True, f"the run completed within the cancel's reach of "
                                 f"{run.reach_with_stall_ms():.2f} ms ({phase} is too short to aim at from here)",
                                 skipped=True))
            else:
                out.append(Check(name, False, f"the run ended {d['outcome']}: {d.get('error', '')}"))
        if not stopped:
            out.append(Check("cancel_stops_a_run", False, "no cancel sent during a run stopped it"))
        return out

    def cancel_word(self) -> Check:
        """An engine that declares cancel_word sees a cancel in the word alone (no line sent), and a word
        left at that run's number does not cancel the next run."""
        if not self.decl.can("cancel_word"):
            return Check("cancel_word", True, "not declared: cancels reach the engine by the line alone", skipped=True)
        if not self.proc.uses_word:
            return Check("cancel_word", True, "declared, but this platform has no private shared region here",
                         skipped=True)
        trial = self._trial("word")
        run = self.run(trial, cancel_at=lambda e: e["type"] in ("phase", "step"), word_only=True)
        d, clock = run.done, self.proc.clock
        self.proc.send({"type": "cancel", "trial": trial})  # late: after its done, ignored
        stale = self.run(self._trial("word-next"))  # the word still holds the first run's number
        problems = run.problems + stale.problems
        outcome, _ = run.outcome(clock)
        if outcome == "completed":
            return Check("cancel_word", True, f"the run completed within the word's reach of "
                         f"{run.reach_with_stall_ms():.2f} ms (too short to aim at from here)", skipped=True)
        if outcome != "cancelled":
            problems.append(f"a cancel stored in the shared word alone was not honoured: the run ended "
                            f"{d['outcome']} {run.done_after_cancel_ms():.1f} ms after the store")
        elif "cancel_received_t" not in d:
            problems.append("cancelled, but done has no cancel_received_t")
        elif d.get("cancel_via") != "word":
            problems.append(f"cancelled with no line sent, but done.cancel_via is {d.get('cancel_via')!r}, not 'word'")
        if stale.done["outcome"] != "completed":
            problems.append(f"the next run ended {stale.done['outcome']}: a word left at an earlier run's number "
                            "cancelled it")
        if problems:
            return Check("cancel_word", False, "; ".join(problems))
        seen = (clock.to_agent(d["cancel_received_t"]) - run.t_cancel_sent) / 1e6
        return Check("cancel_word", True, f"stopped by the word alone (received {seen:.2f} ms after the store, "
                                          f"stopped in {d['phase']}); a stale word did not cancel the next run")

    def cpu(self) -> Check:
        return check_optional.cpu(self.runs, self.proc.clock.uncertainty_ns)

    def cancel_after_done(self) -> Check:
        trial = self._trial("after")
        first = self.run(trial)
        self.proc.send({"type": "cancel", "trial": trial})
        answer = self.proc.ping()  # anything before the pong answered the stray cancel
        nxt = self.run(self._trial("after-next"))
        problems = first.problems + nxt.problems
        if nxt.done["outcome"] != "completed":
            problems.append(f"the run after it ended {nxt.done['outcome']} (a stale cancel kept?)")
        return Check("cancel_after_done", not problems and answer is not None,
                     "; ".join(problems) or "ignored: no answer, the next run completed")

    def malformed_input(self) -> Check:
        proc, problems = self.proc, []
        for line, of in ((b"this is not json\n", None), (b'{"type": "frobnicate"}\n', "frobnicate"),
                         (b'{"type": "run"}\n', "run")):
            proc.send_line(line)
            try:
                msg = {"type": "pong"}
                while msg["type"] == "pong":  # a late pong of a run's ping is no answer to this line
                    msg = proc.check(proc.messages.get(timeout=EVENT_TIMEOUT_S), "an error answer").msg
            except queue.Empty:
                problems.append(f"no answer to {line.strip().decode()[:40]!r}")
                continue
            if msg["type"] != "error":
                problems.append(f"{line.strip().decode()[:40]!r} was answered with {msg['type']}, not error")
            elif msg.get("of") != of:
                problems.append(f"error.of {msg.get('of')!r} for {line.strip().decode()[:40]!r} (expected {of!r})")
        proc.ping()
        return Check("malformed_input", not problems, "; ".join(problems) or "answered with error, still answers ping")

    def shutdown(self) -> Check:
        proc = self.proc.proc
        self.proc.send({"type": "shutdown"})
        try:
            rc = proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return Check("shutdown", False, "still running 5 s after shutdown (killed)")
        left = group_alive(proc.pid)
        strays = end_leftovers(self.proc.mark)  # what it started outside its group (its own session) too
        self.proc.kill()
        problems = ([f"exit status {rc}"] if rc else []) + (["processes left in its group"] if left else []) + \
            ([f"processes it started outlived it (killed): {'; '.join(strays)}"] if strays else [])
        return Check("shutdown", not problems, "; ".join(problems) or "exit status 0, nothing it started is left")


STEPS = ("hello", "clock", "load", "reference", "cancel_before_run", "cancel_in_phases", "cancel_word", "cpu",
         "cancel_after_done", "malformed_input", "shutdown")


# what a step's checks are called (the others: the step's own name)
NAMES = {"reference": ("phases", "steps"), "cancel_in_phases": ("cancel_in_phases",)}


def run_checks(command: list[str], *, models: dict, settings: dict, text: str, mechanism: str | None,
               cwd: str | None = None, startup_timeout_s: float = 30.0) -> tuple[Declaration | None, list[Check]]:
    """Every check against ``command``; raises CheckInputError for bad options."""
    proc = EngineProcess(command, cwd=cwd, startup_timeout_s=startup_timeout_s, answer_timeout_s=EVENT_TIMEOUT_S)
    checker = Checker(proc, models, settings, text, mechanism)
    checks: list[Check] = []
    try:
        for step in STEPS:
            try:
                got = getattr(checker, step)()
            except CheckInputError:
                raise
            except (EngineError, OSError) as exc:
                checks.append(Check(step, False, str(exc)))
                rest = [n for s in STEPS[STEPS.index(step) + 1:] for n in NAMES.get(s, (s,))]
                checks.extend(Check(s, False, f"not run: {step} failed") for s in rest)
                break
            checks.extend(got if isinstance(got, list) else [got])
    finally:
        proc.kill()
    return checker.decl, checks
