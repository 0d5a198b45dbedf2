"""One device's share of a sweep: its trials in plan order, one at a time.

Every device of a sweep is one coroutine on the driver's one event loop
(``run_devices``): a device waiting for its agent costs no thread, and the
loop only reacts to what Ray reports. Driver-delivered cancels are fired by
one timer thread (``cancel_timer.CancelTimer``), never by the loop, so a loop
busy with other devices' records does not make a cancel late.

Per trial: the :class:`~cancelbench.request.TrialRequest` sent to the agent, the driver's
half of the record, the offset resolved on this device's own reference run, the real driver
-> agent cancel hop, the agent's half merged in and the row finalized (``cancelbench.schema``).
An agent that dies mid-trial gives one ``lost`` row; Ray restarts it and the
device goes on; a node that is gone leaves the rest ``not_run``.

Offsets run from one origin for every delivery: the agent's hand-back (or the engine event a
plan anchors to). A driver-delivered cancel waits for that event (``agent.anchor``), converts
event + delay to the driver clock and fires then.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import ray

from cancelbench.request import TrialRequest
from cancelbench.schema import TrialRecord, driver_half, finalize, merge

from .bargein_config import DETECTOR, note_agent_samples, trial_bargein
from .cancel_timer import CancelTimer
from .clock import ClockOffset, driver_now_ns, estimate_offset_async
from .cluster import DeviceSlot
from .config import SweepConfig, trial_settings
from .offsets import ReferenceTimeline, Resolved, resolve_offset
from .plan import TrialSpec

OFFSET_REFRESH_S = 30.0  # re-ping an agent before a trial when its offset estimate is older
# A trial still running after this long is asked for its phase, and again every as long, so a
# trial lost to an agent death says where it died. A shorter trial costs no status call: at
# 0.5 s polls a farm of second-long trials spent about two agent calls per trial on them.
STATUS_EVERY_S = 2.0
STOP_POLL_S = 0.2  # how often the event loop looks at the sweep's stop flag (set from the main thread)
# A cancel aimed at a target shorter than its delivery takes cannot be sure to land in it.
# The reach compared against is a high quantile of the last REACH_SAMPLES measured samples
# (driver: round trips anchor event -> driver -> cancel received), not their median: a
# target the median reaches is still missed by every slower one (on this 2-core host 1 in 5
# driver round trips took 2-8 ms against a median near 1 ms), and REACH_QUANTILE is the
# share a target must be sure of.
REACH_SAMPLES = 64
REACH_QUANTILE = 0.95


class ReferencesFailed(RuntimeError):
    """No reference run of a cell completed: its cancel trials would all fail the same way."""


def _unwrap(exc: BaseException) -> str:
    """One line from an exception raised on an agent (Ray wraps it)."""
    cause = getattr(exc, "cause", None) or exc.__cause__ or exc
    text = f"{type(cause).__name__}: {cause}" if cause is not exc else str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__


@dataclass(frozen=True)
class SweepContext:
    """What every device run of one sweep shares."""

    config: SweepConfig
    out_dir: Path
    sweep_id: str
    inputs: dict  # workload -> input id -> corpus item
    payloads: dict  # workload -> load payload
    record: Callable[[str, dict], None]  # (device key, finalized row) -> the sink
    timer: CancelTimer | None = None  # fires driver-delivered cancels (None: a sweep without any)


@dataclass
class DeviceWork:
    """One device's agent and its share of the plan."""

    key: str
    slot: DeviceSlot
    agent: object  # the Ray actor handle
    trials: list[TrialSpec]
    offset: ClockOffset
    prior_refs: list[dict] = dataclasses.field(default_factory=list)  # reference rows already on disk (resume)


class DeviceRun:
    """Runs one device's trials in plan order, one at a time."""

    def __init__(self, sweep: SweepContext, work: DeviceWork) -> None:
        self.sweep, self.work = sweep, work
        self.key, self.slot, self.agent, self.trials = work.key, work.slot, work.agent, work.trials
        self.offset, self.offset_at_ns = work.offset, driver_now_ns()
        self.workloads = {w.name: w for w in sweep.config.workloads}
        self.refs: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
        for r in work.prior_refs:
            self.refs[(r["workload"], r["mechanism"])].append(r)
        self.described: dict = {}  # the loaded engine's effective settings (agent.load)
        self.loaded_name: str | None = None
        self.last_phase: str | None = None  # last phase seen by status polls during a trial
        self.stopped: str | None = None  # why this device stopped early
        # How late recent cancels arrived after they were due (ns). Driver: the round trip
        # anchor event -> driver -> agent, per (workload, anchor phase), because what the engine
        # does at the event sets it (on this host a TTS trial's start, tokenizing in Python,
        # took 4-10 ms where its prompt phase took under 1.5); None: idle pings (--resume).
        # Agent: its timer's lateness (due -> issued), per workload.
        self.reach_samples_ns: dict[tuple, collections.deque[int]] = collections.defaultdict(
            lambda: collections.deque(maxlen=REACH_SAMPLES))

    async def run(self) -> list[str]:
        for i, trial in enumerate(self.trials):
            try:
                await self._ensure_loaded(trial.workload)
                self.sweep.record(self.key, await self._run_trial(trial))
            except ray.exceptions.ActorUnschedulableError:
                # Its node is gone: this trial and the rest cannot run on this device.
                return self._gave_up(self.trials[i:])
            except ReferencesFailed as exc:
                self.stopped = f"{exc}; stopped before {len(self.trials) - i} trial(s) (listed as not_run)"
                return [t.trial_id for t in self.trials[i:]]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.sweep.record(self.key, self._lost_row(trial, exc))
                if not await self._await_restart():
                    return self._gave_up(self.trials[i + 1:])
        return []

    def _gave_up(self, rest: list[TrialSpec]) -> list[str]:
        print(f"cancelbench: {self.key}: agent gone (host {self.slot.host} left the cluster?); "
              f"{len(rest)} trial(s) not run", file=sys.stderr)
        return [t.trial_id for t in rest]

    async def _ensure_loaded(self, name: str) -> None:
        if self.loaded_name != name:
            self.described = await self.agent.load.remote(self.sweep.payloads[name])
            self.loaded_name = name

    async def _await_restart(self, timeout_s: float = 60.0) -> bool:
        """After an agent death: wait for Ray to restart it (max_restarts); False if it is gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                await asyncio.wait_for(_awaitable(self.agent.ping.remote()), 5)
                self.loaded_name = None  # a restarted agent has no model loaded
                return True
            except ray.exceptions.ActorUnschedulableError:
                return False  # pinned to a node that is gone
            except (asyncio.TimeoutError, ray.exceptions.ActorUnavailableError):
                await asyncio.sleep(0.5)
            except ray.exceptions.RayActorError as exc:
                if "restart" not in str(exc).lower():
                    return False  # died for good (restarts exhausted, node gone)
                await asyncio.sleep(0.5)
        return False

    def _driver_half(self, trial: TrialSpec) -> TrialRecord:
        """Identity, settings and plan: every column the driver owns."""
        config = self.sweep.config
        settings = trial_settings(config, self.workloads[trial.workload], trial.trial_kind, self.described)
        return driver_half(
            sweep_id=self.sweep.sweep_id, trial_id=trial.trial_id, trial_index=trial.trial_index,
            trial_kind=trial.trial_kind, seed=config.seed, input_seed=trial.input_seed,
            offset_seed=trial.offset_seed, input_id=trial.input_id, **settings,
            mechanism=trial.mechanism, delivery=trial.delivery, offset_plan=trial.offset_plan,
            offset_fraction=trial.offset_fraction, target_phase=trial.target_phase,
            clock_offset_ns=self.offset.offset_ns, clock_uncertainty_ns=self.offset.uncertainty_ns,
            host=self.slot.host, backend=self.slot.backend, device=self.slot.device_id,
        )

    def _request(self, trial: TrialSpec, at: Resolved | None, feed_phases: bool = False) -> TrialRequest:
        """The typed request for the agent (the input resolved from the corpus)."""
        item, wl = self.sweep.inputs[trial.workload][trial.input_id], self.workloads[trial.workload]
        bargein = trial_bargein(wl.bargein, trial.trial_id, trial.delivery, self.sweep.config.seed,
                                self.reach_samples_ns["detect", trial.workload])
        wav_out = None
        if trial.trial_kind == "reference" and wl.spec.keeps_audio:  # kept so a person can listen to it
            wav_out = str((self.sweep.out_dir / "audio" / f"{trial.trial_id}.wav").resolve())
        return TrialRequest(
            trial_id=trial.trial_id, trial_kind=trial.trial_kind, mechanism=trial.mechanism,
            delivery=trial.delivery, input_id=trial.input_id, input=item.get("wav") or item.get("text", ""),
            lang=item.get("lang"), wav_out=wav_out, feed_phases=feed_phases,
            bargein=bargein, **({} if at is None else dict(
                offset_ms=max(0.0, at.offset_ms - (bargein.onset_lead_ms if bargein else 0.0)),
                anchor_phase=at.anchor_phase, anchor_step=at.anchor_step, step_fraction=at.step_fraction,
                anchor_ref_ms=at.anchor_ref_ms)))

    def _resolve(self, trial: TrialSpec) -> tuple[Resolved | None, float | None]:
        """(the cancel's anchor and delay, reference_ms) of a cancel trial, on this device's reference run."""
        if trial.trial_kind != "cancel":
            return None, None
        refs = self.refs.get((trial.workload, trial.mechanism), [])
        if refs and not any(r.get("outcome") == "completed" for r in refs):
            raise ReferencesFailed(f"{self.key}: workload {trial.workload}: none of the {len(refs)} reference "
                                   f"runs of {trial.mechanism} completed; first error: "
                                   f"{' '.join(str(refs[0].get('error')).split())[:300]}")
        pooled = [r for (workload, _), rows in self.refs.items() if workload == trial.workload for r in rows]
        timeline = ReferenceTimeline.from_rows(refs, pooled)
        return resolve_offset(trial, timeline), (timeline.duration_ms if timeline else None)

    async def _run_trial(self, trial: TrialSpec) -> dict:
        await self._refresh_offset()
        base = self._driver_half(trial)
        try:
            at, base.reference_ms = self._resolve(trial)
        except ValueError as exc:
            return finalize(dataclasses.replace(base, outcome="error", error=str(exc)))
        if at is not None:
            base.offset_target_ms, base.anchor_step = at.offset_ms, at.anchor_step
            if at.window_ms is not None:
                base.target_window_ms = at.window_ms
                base.delivery_reach_ms = await self._reach_ms(trial.delivery, trial.workload, at.anchor_phase)
                # due at anchor + delay, received up to the delivery's reach later
                base.target_reachable = at.window_ms - at.offset_ms > base.delivery_reach_ms
        # A driver-delivered cancel asks for its anchor before the trial starts: the agent holds
        # the question until the event, so the answer leaves at the event. Asked after the
        # trial, the question's own trip was part of the event hop, and an anchor at the start
        # (the first phase, entered at hand-back) reached the driver 3-5 ms late.
        anchor = self.agent.anchor.remote(trial.trial_id) if at is not None and trial.delivery == "driver" else None
        # A reference run of a driver-delivered anchored sweep feeds its phase entries, and the
        # driver times the cancel path from each (asked before the trial, like an anchor).
        feed = (trial.trial_kind == "reference" and self.sweep.timer is not None
                and self.sweep.config.offsets.kind.anchored)
        probing = asyncio.ensure_future(self._probe_phase_entries(
            trial.workload, trial.trial_id, self.agent.next_phase_entry.remote(trial.trial_id, first=True))) if feed else None
        if probing is not None:  # an agent that died mid-run fails it too: the trial's record says so
            probing.add_done_callback(lambda f: f.cancelled() or f.exception())
        ref = self.agent.run_trial.remote(self._request(trial, at, feed_phases=feed))
        issue, cancel_ref = {}, None
        result = asyncio.ensure_future(_awaitable(ref))
        # If the cancel path fails first (the agent died), the trial's own failure is still read.
        result.add_done_callback(lambda f: f.cancelled() or f.exception())
        if anchor is not None:
            issue, cancel_ref = await self._deliver_from_driver(trial.trial_id, anchor)
        record = dataclasses.replace(merge(base, await self._watch(result)), **issue)
        if probing is not None:
            try:
                trips = await probing
            except Exception:  # the probes' answer was lost; the reference run stands without it
                trips = {}
            record.round_trip_probes_ms_json = json.dumps(
                {phase: [round(ns / 1e6, 4) for ns in ms] for phase, ms in trips.items()})
        if cancel_ref is not None:
            # the hop is finished before the next trial; its effect is t_received_ns
            received_ns = (await cancel_ref).get("received_ns")
            if received_ns is not None and issue:
                # the round trip, without the wait for a due time after the driver saw the event
                waited = max(0, issue["t_cancel_scheduled_ns"] - issue["t_anchor_seen_ns"])
                self.reach_samples_ns["driver", trial.workload, at.anchor_phase].append(
                    received_ns - record.t_anchor_ns - waited)
        if trial.delivery in ("agent", DETECTOR):  # issued on the agent's own clock
            record.clock_uncertainty_ns = 0
            note_agent_samples(self.reach_samples_ns, trial.workload, record)
        row = finalize(record)
        if trial.trial_kind == "reference":
            self.refs[(trial.workload, trial.mechanism)].append(row)
        return row

    async def _deliver_from_driver(self, trial_id: str, anchor_ref) -> tuple[dict, object]:
        """Wait for the trial's anchor event on the agent (``anchor_ref``: its ``agent.anchor``),
        then have the cancel timer fire at anchor + delay (converted to the driver clock). The
        event's hop to the driver is recorded (``t_anchor_seen_ns``); a due time it already
        passed fires at once, and ``schedule_lag_ms`` says by how much. No event (the trial ended first): no cancel.
        The event goes from Ray's thread straight to the timer (``CancelTimer.fire_after``);
        this coroutine only collects the stamps."""
        agent, offset = self.agent, self.offset

        def schedule(anchor):
            if anchor is None:
                return None
            t_anchor_ns, delay_ns = anchor
            return offset.to_driver(t_anchor_ns + delay_ns), lambda: agent.cancel.remote(trial_id)

        fired = await asyncio.wrap_future(self.sweep.timer.fire_after(anchor_ref.future(), schedule))
        if fired is None:
            return {}, None
        seen, (t_anchor_ns, delay_ns), issued, cancel_ref = fired
        return {"t_issued_driver_ns": issued, "t_issued_ns": offset.to_agent(issued),
                "t_cancel_scheduled_ns": t_anchor_ns + delay_ns,
                "t_anchor_seen_ns": offset.to_agent(seen)}, cancel_ref

    async def _probe_phase_entries(self, workload: str, trial_id: str, question) -> dict[str, list[int]]:
        """During a reference run: the cancel path timed from each phase entry, as a cancel
        anchored there travels (the agent answers ``next_phase_entry`` at the entry -> Ray's
        callback -> the cancel timer -> an agent call, timed on the agent's clock). A phase
        entered while the previous answer was on its way is skipped. Returns phase -> round
        trips (ns), also kept as reach samples."""
        taken = {}
        while (answered := await self._through_cancel_path(question)) is not None:
            (phase, t_entry_ns), back = answered
            question = self.agent.next_phase_entry.remote(trial_id)  # at once: the next entry may be near
            taken.setdefault(phase, []).append(await back - t_entry_ns)
        for phase, trips in taken.items():
            self.reach_samples_ns["driver", workload, phase].extend(trips)
        return taken

    async def _through_cancel_path(self, ref):
        """Once ``ref`` (an agent call) answers, the cancel timer at once makes an agent call,
        as it fires a driver-delivered cancel: (the answer, the ObjectRef of that call's agent
        clock), or None if the answer was None."""
        agent = self.agent
        fired = await asyncio.wrap_future(self.sweep.timer.fire_after(
            ref.future(), lambda value: None if value is None else (driver_now_ns(), agent.ping.remote)))
        if fired is None:
            return None
        _, value, _, back = fired
        return value, back

    async def _reach_ms(self, delivery: str, workload: str, phase: str | None) -> float:
        """How late a cancel of ``delivery`` anchored at ``phase`` of ``workload`` may arrive
        after it is due (REACH_QUANTILE of its recent samples). Without samples yet (the
        references ran before a --resume): ``ping_samples`` idle round trips through the
        cancel path, or the agent's timer probes."""
        key = ("driver", workload, phase) if delivery == "driver" else ("agent", workload)
        samples = self.reach_samples_ns[key] or self.reach_samples_ns[key[:2] + (None,)]
        if not samples:
            n = max(1, self.sweep.config.ping_samples)
            if delivery == "driver":
                for _ in range(n):
                    sent_ns, back = await self._through_cancel_path(self.agent.ping.remote())
                    samples.append(await back - sent_ns)
            else:
                samples.extend(await self.agent.timer_probe.remote(n))
        return reach_ns(samples) / 1e6

    async def _watch(self, result: asyncio.Future):
        """The trial's result; every STATUS_EVERY_S meanwhile its phase, so a trial lost to
        an agent death says where it died. No timeout: field-scale trials run for minutes."""
        self.last_phase = None
        while True:
            done, _ = await asyncio.wait({result}, timeout=STATUS_EVERY_S)
            if done:
                return result.result()
            try:
                status = await asyncio.wait_for(_awaitable(self.agent.status.remote()), 5)
                # a reply after the trial ended says no phase: keep the last one seen while it ran
                self.last_phase = status.get("phase") or self.last_phase
            except Exception:
                return await result

    async def _refresh_offset(self) -> None:
        """Re-estimate the clock offset when the last estimate is older than
        OFFSET_REFRESH_S: host clocks drift apart by tens of µs per second, which
        over a sweep of long trials would bias every driver-side timestamp."""
        if driver_now_ns() - self.offset_at_ns < OFFSET_REFRESH_S * 1e9:
            return
        self.offset = await estimate_offset_async(lambda: _awaitable(self.agent.ping.remote()),
                                                  max(5, self.sweep.config.ping_samples // 4))
        self.offset_at_ns = driver_now_ns()

    def _lost_row(self, trial: TrialSpec, exc: BaseException) -> dict:
        return finalize(dataclasses.replace(self._driver_half(trial), outcome="lost", phase_at_terminal=self.last_phase,
                                            error=f"agent died during the trial: {_unwrap(exc)}"[:2000]))


def reach_ns(samples_ns) -> int:
    """The REACH_QUANTILE of the samples (nearest rank: with under 20 of them, the slowest)."""
    ordered = sorted(samples_ns)
    return ordered[min(len(ordered) - 1, math.ceil(REACH_QUANTILE * len(ordered)) - 1)]


async def _awaitable(ref):
    """An ObjectRef as a coroutine (asyncio.wait_for and ensure_future take those)."""
    return await ref


def run_devices(runs: list[DeviceRun], on_done: Callable[[DeviceRun, list[str] | BaseException], None],
                stop: threading.Event) -> threading.Thread:
    """Run every device's trials on one event loop in a new thread (started; join it).
    ``on_done(run, not_run_ids or the exception)`` is called once per device, on that
    thread. ``stop`` set: the devices still running are cancelled at their next await,
    after the record they were taking (the sweep takes no more, see runner.record)."""
    async def device(run: DeviceRun) -> None:
        try:
            on_done(run, await run.run())
        except BaseException as exc:  # asyncio.CancelledError included: the sweep stopped
            on_done(run, exc)

    async def main() -> None:
        tasks = [asyncio.create_task(device(r), name=f"device-{r.key}") for r in runs]
        pending = set(tasks)
        while pending:
            _, pending = await asyncio.wait(pending, timeout=STOP_POLL_S)
            if stop.is_set():
                for t in pending:
                    t.cancel()

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="driver-loop", daemon=True)
    thread.start()
    return thread
