"""One device's share of a sweep: its trials in plan order, one at a time.

Per trial: the driver's half of the record, the offset resolved on this
device's own reference timeline, the real driver -> agent cancel hop, the
agent's half merged in and the row finalized (``cancelbench.schema``). An agent
that dies mid-trial gives one ``lost`` row; Ray restarts it and the device
goes on; a node that is gone leaves the rest ``not_run``.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Callable

import ray

from cancelbench.schema import TrialRecord, finalize, merge

from .clock import ClockOffset, driver_now_ns, estimate_offset
from .cluster import DeviceSlot
from .config import SweepConfig
from .plan import ReferenceTimeline, TrialSpec, resolve_offset_ms

OFFSET_REFRESH_S = 30.0  # re-ping an agent before a trial when its offset estimate is older


class ReferencesFailed(RuntimeError):
    """No reference run of a cell completed: its cancel trials would all fail the same way."""


def _unwrap(exc: BaseException) -> str:
    """One line from an exception raised on an agent (Ray wraps it)."""
    cause = getattr(exc, "cause", None) or exc.__cause__ or exc
    text = f"{type(cause).__name__}: {cause}" if cause is not exc else str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__


def _reference_timeline(rows: list[dict]) -> ReferenceTimeline | None:
    """The median uncancelled run: its duration and its phase timeline come from
    the same run (the lower median, a real run, for an even count)."""
    done = [r for r in rows if r.get("outcome") == "completed" and r.get("duration_ms") is not None]
    if not done:
        return None
    done.sort(key=lambda r: r["duration_ms"])
    median = done[(len(done) - 1) // 2]
    segs = tuple(tuple(s) for s in json.loads(median.get("phase_timeline_json") or "[]"))
    return ReferenceTimeline(duration_ms=median["duration_ms"], segments=segs)


def _sleep_until_driver(deadline_ns: int) -> None:
    while True:
        left = deadline_ns - driver_now_ns()
        if left <= 0:
            return
        if left > 2_000_000:
            time.sleep((left - 1_000_000) / 1e9)


class DeviceRun:
    """Runs one device's trials in plan order, one at a time."""

    def __init__(self, config: SweepConfig, out_dir: Path, key: str, slot: DeviceSlot, agent, trials: list[TrialSpec],
                 inputs: dict, payloads: dict, offset: ClockOffset, sweep_id: str, prior_refs: list[dict],
                 record: Callable[[str, dict], None]) -> None:
        self.config, self.out_dir, self.key, self.slot, self.agent = config, out_dir, key, slot, agent
        self.trials, self.inputs, self.payloads, self.offset = trials, inputs, payloads, offset
        self.offset_at_ns = driver_now_ns()
        self.sweep_id, self.record = sweep_id, record
        self.refs: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
        for r in prior_refs:
            self.refs[(r["workload"], r["mechanism"])].append(r)
        self.loaded: dict | None = None
        self.loaded_name: str | None = None
        self.last_phase: str | None = None  # last phase seen by status polls during a trial
        self.stopped: str | None = None  # why this device stopped early

    def run(self) -> list[str]:
        for i, trial in enumerate(self.trials):
            try:
                self._ensure_loaded(trial.workload)
                self.record(self.key, self._run_trial(trial))
            except ray.exceptions.ActorUnschedulableError:
                # Its node is gone: this trial and the rest cannot run on this device.
                return self._gave_up(self.trials[i:])
            except ReferencesFailed as exc:
                self.stopped = f"{exc}; stopped before {len(self.trials) - i} trial(s) (listed as not_run)"
                return [t.trial_id for t in self.trials[i:]]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.record(self.key, self._lost_row(trial, exc))
                if not self._await_restart():
                    return self._gave_up(self.trials[i + 1:])
        return []

    def _gave_up(self, rest: list[TrialSpec]) -> list[str]:
        print(f"cancelbench: {self.key}: agent gone (host {self.slot.host} left the cluster?); "
              f"{len(rest)} trial(s) not run", file=sys.stderr)
        return [t.trial_id for t in rest]

    def engine_of(self, workload: str) -> str:
        return next(w.engine for w in self.config.workloads if w.name == workload)

    def _ensure_loaded(self, name: str) -> None:
        if self.loaded_name != name:
            self.loaded = ray.get(self.agent.load.remote(self.payloads[name]))
            self.loaded_name = name

    def _await_restart(self, timeout_s: float = 60.0) -> bool:
        """After an agent death: wait for Ray to restart it (max_restarts); False if it is gone."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                ray.get(self.agent.ping.remote(), timeout=5)
                self.loaded_name = None  # a restarted agent has no model loaded
                return True
            except ray.exceptions.ActorUnschedulableError:
                return False  # pinned to a node that is gone
            except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
                time.sleep(0.5)
            except ray.exceptions.RayActorError as exc:
                if "restart" not in str(exc).lower():
                    return False  # died for good (restarts exhausted, node gone)
                time.sleep(0.5)
        return False

    def _base_record(self, trial: TrialSpec) -> TrialRecord:
        """The driver's half of the record: identity, plan and workload settings."""
        wl = next(w for w in self.config.workloads if w.name == trial.workload)
        info = self.loaded or {}
        model = Path(wl.model).name.replace("fixture:", "") if wl.engine != "probe" else "probe"
        return TrialRecord(
            sweep_id=self.sweep_id, trial_id=trial.trial_id, trial_index=trial.trial_index,
            trial_kind=trial.trial_kind, seed=self.config.seed, input_seed=trial.input_seed,
            offset_seed=trial.offset_seed, workload=trial.workload, engine=wl.engine, model=model,
            model_sha256=info.get("model_sha256"),
            n_ctx=info.get("n_ctx"), n_batch=info.get("n_batch", wl.n_batch), n_ubatch=info.get("n_ubatch", wl.n_ubatch),
            chunk_tokens=info.get("chunk_tokens", wl.chunk_tokens), max_tokens=info.get("max_tokens", wl.max_tokens),
            n_gpu_layers=info.get("n_gpu_layers", wl.n_gpu_layers), input_id=trial.input_id,
            mechanism=trial.mechanism, delivery=trial.delivery, offset_plan=trial.offset_plan,
            offset_fraction=trial.offset_fraction, target_phase=trial.target_phase,
            clock_offset_ns=self.offset.offset_ns, clock_uncertainty_ns=self.offset.uncertainty_ns,
            host=self.slot.host, backend=self.slot.backend, device=self.slot.device_id,
        )

    def _trial_spec(self, trial: TrialSpec) -> dict:
        """What the agent needs to run the trial (inputs resolved from the corpus)."""
        item = self.inputs[trial.workload][trial.input_id]
        spec = {"trial_id": trial.trial_id, "input_id": trial.input_id, "mechanism": trial.mechanism,
                "delivery": trial.delivery, "seed": self.config.seed, "input": item.get("text", ""),
                "wav": item.get("wav"), "lang": item.get("lang")}
        if trial.trial_kind == "reference" and self.engine_of(trial.workload) == "tts":
            # An uncancelled synthesis is kept so a person can listen to it.
            spec["wav_out"] = str((self.out_dir / "audio" / f"{trial.trial_id}.wav").resolve())
        return spec

    def _run_trial(self, trial: TrialSpec) -> dict:
        self._refresh_offset()
        base = self._base_record(trial)
        spec = self._trial_spec(trial)
        ref_key = (trial.workload, trial.mechanism)
        target_ms = None
        if trial.trial_kind == "cancel":
            refs = self.refs.get(ref_key, [])
            timeline = _reference_timeline(refs)
            if refs and not any(r.get("outcome") == "completed" for r in refs):
                raise ReferencesFailed(f"{self.key}: workload {trial.workload}: none of the {len(refs)} reference "
                                       f"runs of {trial.mechanism} completed; first error: "
                                       f"{' '.join(str(refs[0].get('error')).split())[:300]}")
            try:
                target_ms = resolve_offset_ms(trial, timeline)
            except ValueError as exc:
                return finalize(dataclasses.replace(base, outcome="error", error=str(exc)))
            base.offset_target_ms = target_ms
            base.reference_ms = timeline.duration_ms if timeline else None
            if trial.delivery == "agent":
                spec["offset_ms"] = target_ms
        issue: dict = {}
        cancel_ref = None
        t_sub = driver_now_ns()
        ref = self.agent.run_trial.remote(spec)
        if trial.trial_kind == "cancel" and trial.delivery == "driver":
            scheduled = t_sub + int(target_ms * 1e6)
            _sleep_until_driver(scheduled)
            issued = driver_now_ns()
            cancel_ref = self.agent.cancel.remote(trial.trial_id)
            issue = {"t_issued_driver_ns": issued, "t_issued_ns": self.offset.to_agent(issued),
                     "t_cancel_scheduled_ns": self.offset.to_agent(scheduled)}
        self._watch(ref)
        record = dataclasses.replace(merge(base, ray.get(ref)), **issue)
        if cancel_ref is not None:
            ray.get(cancel_ref)  # the hop is finished before the next trial; its effect is t_received_ns
        if trial.delivery == "agent":
            record.clock_uncertainty_ns = 0  # issued on the agent's own clock
        row = finalize(record)
        if trial.trial_kind == "reference":
            self.refs[ref_key].append(row)
        return row

    def _watch(self, ref) -> None:
        """Wait for a trial; note its phase meanwhile, so a trial lost to an agent
        death says where it died. No timeout: field-scale trials run for minutes."""
        self.last_phase = None
        while not ray.wait([ref], timeout=0.5)[0]:
            try:
                self.last_phase = ray.get(self.agent.status.remote(), timeout=5).get("phase")
            except Exception:
                return

    def _refresh_offset(self) -> None:
        """Re-estimate the clock offset when the last estimate is older than
        OFFSET_REFRESH_S: host clocks drift apart by tens of µs per second, which
        over a sweep of long trials would bias every driver-side timestamp."""
        if driver_now_ns() - self.offset_at_ns < OFFSET_REFRESH_S * 1e9:
            return
        self.offset = estimate_offset(lambda: ray.get(self.agent.ping.remote()), max(5, self.config.ping_samples // 4))
        self.offset_at_ns = driver_now_ns()

    def _lost_row(self, trial: TrialSpec, exc: BaseException) -> dict:
        return finalize(dataclasses.replace(self._base_record(trial), outcome="lost", phase_at_terminal=self.last_phase,
                                            error=f"agent died during the trial: {_unwrap(exc)}"[:2000]))
