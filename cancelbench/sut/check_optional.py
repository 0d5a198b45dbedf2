"""sut-check's checks of the protocol's optional features (cancelbench.sut.check runs them): the
trial thread's readings an engine sends (1.3, ``done.cpu``), and the audio an engine that
declares ``audio_out`` hands over (1.4). Pure functions over what the checker saw."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False  # could not be tried here (ok stays True: nothing failed)


def cpu(runs: list, uncertainty_ns: int) -> Check:
    """Every ``done.cpu`` of ``runs`` (check.Run) passes the agent's checks (device_agents/engines/
    engine_cpu.py): one thread's readings, never backwards, within the time the run was in the
    engine's hands; SKIP for an engine that sends none."""
    from cancelbench.device_agents.engines import engine_cpu

    sent = [r for r in runs if r.done is not None and r.done.get("cpu")]
    if not sent:
        return Check("cpu", True, "no done.cpu sent (optional): its records have no residue split", skipped=True)
    problems = []
    for r in sent:
        seen = next((e.get("cpu_t") for e in r.events if e["type"] == "cancel_seen"), None)
        try:
            engine_cpu.check(r.done["cpu"], seen, "cancel_received_t" in r.done,
                             r.t_done_read - r.t_run + 2 * uncertainty_ns)
        except ValueError as exc:
            problems.append(f"{r.trial}: {exc}")
    return Check("cpu", not problems, "; ".join(problems) or f"the trial thread's readings of {len(sent)} of "
                 f"{len(runs)} runs agree with what the checker saw")


def audio(loaded: dict, run) -> Check:
    """An engine that declares audio_out: its rate when loaded, its reference run's audio handed over."""
    rate = loaded.get("audio_sample_rate")
    chunks = [e["samples"] for e in run.events if e["type"] == "audio"]
    problems = [] if rate else ["loaded has no audio_sample_rate"]
    if not chunks:
        problems.append("the reference run handed no audio over (no audio event)")
    if problems:
        return Check("audio", False, "; ".join(problems))
    return Check("audio", True, f"{len(chunks)} hand-over(s), {sum(chunks)} samples "
                                f"({sum(chunks) / rate:.2f} s at {rate} Hz)")
