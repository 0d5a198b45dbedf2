"""The sweep driver: validate, plan, start agents, run the devices, sink records.

Side effects live here and in device_run.py (Ray, files); planning and
record maths are pure functions in plan.py and cancelbench.schema.
"""

from __future__ import annotations

import asyncio
import collections
import os
import platform
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from cancelbench import compaction
from cancelbench import sink as sinks
from cancelbench.datasets.locks import LockError, check_size, load_lock
from cancelbench.device_agents.model_check import ModelMismatchError, check_workload_files
from cancelbench.fileio import write_atomic, write_json_atomic
from cancelbench.schema import SCHEMA_VERSION

from . import cluster
from .clock import estimate_offset
from .config import MAX_PLAN_TRIALS, SweepConfig, WorkloadSpec
from .corpus import load_inputs
from .cancel_timer import CancelTimer
from .device_run import DeviceRun, DeviceWork, SweepContext, _unwrap, run_devices
from .progress import ProgressBars, Recorder
from .workloads import sweep_seeded
from .plan import (PLAN_HASH, Plan, build_plan, legacy_plan_sha256, plan_sha256,
                   planned_trials)
from .plan import plan_table as plan_table_of


class SweepInputError(ValueError):
    """Bad input discovered before any trial ran (exit code 2)."""


@dataclass
class SweepResult:
    out_dir: Path
    sweep_id: str
    planned: int
    written: int
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    not_run: list[str] = field(default_factory=list)
    prior_outcomes: collections.Counter = field(default_factory=collections.Counter)  # on disk before --resume
    stopped: list[str] = field(default_factory=list)  # one line per device stopped early (ReferencesFailed)
    first_error: str | None = None  # "trial id: error" of this run's first error record (the exit-1 line)

    @property
    def failures(self) -> int:
        return sum(self.outcomes[k] + self.prior_outcomes[k] for k in ("dropped", "lost", "error"))

    @property
    def exit_code(self) -> int:
        # a trial that never ran, or a device stopped early, is a failure too
        return 1 if self.failures or self.not_run or self.stopped else 0

    def failure_reasons(self, defects: bool = True) -> list[str]:
        """Why ``exit_code`` is 1, as counts; ``defects=False``: not the dropped and lost (a report's own defects)."""
        n = self.outcomes + self.prior_outcomes
        said = [(n["error"], "trial(s) ended in error"), (defects and n["dropped"], "dropped cancel(s)"),
                (defects and n["lost"], "lost trial(s)"), (len(self.not_run), "planned trial(s) not run"),
                (len(self.stopped), "device(s) stopped early")]
        return [f"{k} {what}" for k, what in said if k]


def _noting_first_error(record, result: SweepResult):
    """``record`` that also keeps the first ``error`` record's trial id and error in ``result``."""
    def note(key: str, row: dict) -> None:
        record(key, row)
        if row.get("outcome") == "error" and result.first_error is None:
            result.first_error = f"{row.get('trial_id')}: {row.get('error') or 'no message'}"
    return note


def workload_payload(wl: WorkloadSpec, driver_sees_files: bool = False) -> dict:
    """Engine parameters plus the lock entries the agent verifies before loading.

    The sha256 is verified once, on the agent, before load. With
    ``driver_sees_files`` (a local cluster) the driver checks existence and
    size here, so a missing or truncated file fails before Ray starts.
    """
    payload = wl.engine_params()
    locks: dict = {}
    for key in ("model", "mmproj"):
        spec = getattr(wl, key)
        if not spec or not wl.spec.needs_model:
            continue
        if spec.startswith("fixture:"):
            from cancelbench.datasets.fixtures import fixture_lock_entries
            try:
                locks.update(fixture_lock_entries(spec.split(":", 1)[1]))
            except KeyError as exc:
                raise SweepInputError(f"workload {wl.name}: {exc.args[0]}") from None
            continue
        entries = load_lock(Path(wl.lock))
        path = Path(spec).expanduser()
        if path.name not in entries:
            raise SweepInputError(f"workload {wl.name}: lock {wl.lock} has no entry for {path.name}")
        if path.exists() or driver_sees_files:
            check_size(path, entries[path.name])
        e = entries[path.name]
        locks[path.name] = {"size": e.size, "sha256": e.sha256, "source": e.source}
    payload["locks"] = locks
    if not wl.spec.needs_model:
        payload.pop("model", None)
        payload.pop("mmproj", None)
    return payload


class Sweep:
    """One sweep run. ``run()`` returns a :class:`SweepResult`."""

    def __init__(self, config: SweepConfig, out_dir: Path, *, address: str | None = None, resume: bool = False,
                 progress: bool = True, max_restarts: int = 3) -> None:
        self.config = config
        self.out_dir = Path(out_dir)
        self.address = address
        self.resume = resume
        self.show_progress = progress
        self.max_restarts = max_restarts
        self._stop = threading.Event()

    # -- validation, before anything is written --------------------------------
    def _validate(self) -> tuple[dict, dict, dict]:
        inputs = {}
        for wl in self.config.workloads:
            items = (load_inputs(wl) if wl.spec.declaration.input != "none" else  # one synthetic input
                     [{"id": wl.spec.synthetic_input_id, "text": ""}])
            inputs[wl.name] = {str(it["id"]): it for it in items}
        try:
            local = not (self.address or os.environ.get("RAY_ADDRESS"))
            payloads = {wl.name: sweep_seeded(workload_payload(wl, driver_sees_files=local), wl, self.config.seed)
                        for wl in self.config.workloads}
            for wl in self.config.workloads:  # architecture vs engine, for the files this driver sees
                if not wl.spec.external:  # an external engine's models are its own business
                    check_workload_files(wl.engine, {"model": wl.model, "mmproj": wl.mmproj}, local)
        except (LockError, ModelMismatchError) as exc:
            raise SweepInputError(str(exc)) from None
        manifest_path = self.out_dir / sinks.MANIFEST
        existing = None
        if self.resume:
            existing = sinks.read_manifest(self.out_dir)
            sinks.check_schema_version(self.out_dir)
            sinks.completed_trial_ids(self.out_dir)  # a damaged records file: exit 2 before Ray starts
            if existing.get("config") != self.config.to_json():
                raise SweepInputError(f"{self.out_dir}: --resume with a different config than the one recorded "
                                      "in its manifest (same config required for exactly-once trials)")
        elif manifest_path.exists() or manifest_path.is_symlink():
            raise SweepInputError(f"{self.out_dir} already holds a sweep; use --resume to continue it "
                                  "or choose another --out directory")
        elif sinks.records_dir(self.out_dir).exists():
            raise SweepInputError(f"{self.out_dir} holds records/ but no {sinks.MANIFEST} (deleted?): restore it and "
                                  f"use --resume, or move {sinks.records_dir(self.out_dir)} away (or choose another "
                                  "--out) to start a new sweep")
        return inputs, payloads, existing or {}

    def run(self) -> SweepResult:
        with sinks.locked_output(self.out_dir):  # one sweep per --out at a time
            return self._run_locked()

    def _run_locked(self) -> SweepResult:
        inputs, payloads, existing = self._validate()
        try:
            cluster.connect(self.address)  # a cluster whose auth mode we cannot match: input error
            slots = cluster.discover_slots(self.config.devices)
        except cluster.ClusterError as exc:
            raise SweepInputError(str(exc)) from None
        n_planned = planned_trials(self.config, [s.key for s in slots])
        if n_planned > MAX_PLAN_TRIALS:  # the limit is per sweep: it does not grow with the cluster
            raise SweepInputError(f"the plan has {n_planned} trials on {len(slots)} device(s), more than "
                                  f"{MAX_PLAN_TRIALS} (the most a sweep allows); lower sweep.trials_per_cell, select fewer "
                                  "devices ([devices]) or split the sweep")
        n_threads = max(w.resolved_settings().get("n_threads") or 1 for w in self.config.workloads)
        sweep_id = existing.get("sweep_id") or f"sw-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        # Named, so an operator (or a test) can find a sweep's agents: cancelbench/<sweep>/<host>/<device>.
        agents = {s.key: cluster.start_agent(s, n_threads, self.max_restarts, name=f"{sweep_id}/{s.key}")
                  for s in slots}
        try:
            return self._run(sweep_id, slots, agents, inputs, payloads, existing)
        finally:
            _kill_agents(agents)

    def _run(self, sweep_id, slots, agents, inputs, payloads, existing) -> SweepResult:
        slot_by_key = {s.key: s for s in slots}
        probes, offsets = self._prepare_agents(slot_by_key, agents, payloads)
        plan = build_plan(self.config, list(agents), {n: list(v) for n, v in inputs.items()})
        try:
            manifest = self._start_dataset(sweep_id, plan, probes, offsets, existing)
            return self._run_plan(plan, manifest, sweep_id, slot_by_key, agents, inputs, payloads, offsets)
        except KeyboardInterrupt:  # a signal: also one that came before the trials' own handling began
            self._mark_interrupted()
            raise

    def _mark_interrupted(self) -> None:
        """A manifest this sweep left "running" says "interrupted" (a signal that arrived between
        writing it and the trials, e.g. while plan.parquet was written, left it "running")."""
        path = self.out_dir / sinks.MANIFEST
        try:
            manifest = sinks.read_manifest(self.out_dir)
        except Exception:  # none written yet: nothing claims the sweep is running
            return
        if manifest.get("status") == "running":
            write_json_atomic(path, {**manifest, "status": "interrupted"})

    def _run_plan(self, plan, manifest, sweep_id, slot_by_key, agents, inputs, payloads, offsets) -> SweepResult:
        """The plan's trials on every device, into the dataset; the manifest's final status."""
        if self.resume:  # finish what a driver killed mid-compaction left, before new files join
            compaction.recover(sinks.records_dir(self.out_dir))
        done_ids = sinks.completed_trial_ids(self.out_dir) if self.resume else set()
        prior_outcomes = sinks.outcome_counts(self.out_dir) if done_ids else collections.Counter()
        prior_refs = self._prior_reference_rows(done_ids) if done_ids else {}
        by_device = plan.by_device(skip=done_ids)
        result = SweepResult(self.out_dir, sweep_id, planned=len(plan), written=0, prior_outcomes=prior_outcomes)
        sink = sinks.RecordSink(self.out_dir)
        progress = ProgressBars({k: len(by_device.get(k, [])) for k in agents}, self.show_progress)
        stop = self._stop
        record = _noting_first_error(Recorder(sink, result, progress, stop, _Stopping), result)

        timer = CancelTimer() if "driver" in self.config.deliveries else None
        shared = SweepContext(self.config, self.out_dir, sweep_id, inputs, payloads, record, timer)
        runs = [DeviceRun(shared, DeviceWork(key, slot_by_key[key], agents[key], trials, offsets[key],
                                             prior_refs.get(key, [])))
                for key, trials in by_device.items()]
        errors: list[BaseException] = []
        interrupted = False
        try:
            _run_in_parallel(runs, result, errors, stop, lambda: _kill_agents(agents))
            errors[:] = [e for e in errors if not isinstance(e, (_Stopping, asyncio.CancelledError))]
        except BaseException as exc:  # KeyboardInterrupt (a signal): the dataset is partial
            interrupted = isinstance(exc, KeyboardInterrupt)
            raise
        finally:
            if timer is not None:
                timer.close()
            try:
                sink.close()  # raises SinkError if records had to be kept elsewhere (full disk)
            finally:
                progress.close()
                try:
                    self._compact(sink)
                except KeyboardInterrupt:  # a signal during compaction: stopped safely, say interrupted
                    interrupted = True
                    raise
                finally:
                    if not interrupted and not sink.last_error:
                        result.not_run.extend(self._missing(plan, result.not_run))
                    manifest["status"] = ("interrupted" if interrupted else
                                          "complete" if not result.not_run and not errors and not sink.last_error
                                          else "incomplete")
                    manifest["not_run"] = sorted(result.not_run)
                    write_json_atomic(self.out_dir / sinks.MANIFEST, manifest)
        if errors:
            raise errors[0]
        return result

    def _compact(self, sink: sinks.RecordSink) -> None:
        """One file per partition at every sweep end (complete, interrupted, resumed). It only
        rewrites what is on disk, so a failure or a kill leaves the small files, each record
        still read once: a warning, not a failed sweep (--resume compacts again)."""
        if sink.disk_full:
            return  # the rewrite needs as much room again as the records: there is none
        try:
            before, after = compaction.compact(sinks.records_dir(self.out_dir))
        except Exception as exc:  # a full disk now, a damaged file: the dataset stays as the sink wrote it
            print(f"cancelbench: warning: the records in {self.out_dir} were not compacted "
                  f"({' '.join(str(exc).split())[:300]}); they are complete as they are, --resume compacts "
                  "them", file=sys.stderr)
            return
        if self.show_progress and before > after:
            print(f"records: compacted {before} files into {after}", file=sys.stderr)

    def _missing(self, plan: Plan, not_run: list[str]) -> list[str]:
        """Planned trials neither on disk nor listed as not run: never call such a dataset complete."""
        on_disk = sinks.completed_trial_ids(self.out_dir)
        known = on_disk.union(not_run)
        return [tid for tid in plan.column("trial_id") if tid not in known]

    def _prepare_agents(self, slot_by_key: dict, agents: dict, payloads: dict) -> tuple[dict, dict]:
        """Probe every agent's device, load every workload once (a bad model is an
        input error before any trial), and estimate each agent's clock offset."""
        probes = dict(zip(agents, ray.get([a.probe.remote() for a in agents.values()])))
        try:
            cluster.check_agents([slot_by_key[k] for k in probes], list(probes.values()))
        except cluster.ClusterError as exc:
            raise SweepInputError(str(exc)) from None
        for key, agent in agents.items():
            for wl in self.config.workloads:
                try:
                    ray.get(agent.load.remote(payloads[wl.name]))
                except ray.exceptions.RayTaskError as exc:
                    raise SweepInputError(f"{key}: workload {wl.name}: {_unwrap(exc)}") from None
        offsets = {k: estimate_offset(lambda a=a: ray.get(a.ping.remote()), self.config.ping_samples)
                   for k, a in agents.items()}
        return probes, offsets

    def _start_dataset(self, sweep_id: str, plan: Plan, probes: dict, offsets: dict,
                       existing: dict) -> dict:
        """Write plan.parquet (once) and the manifest, status "running"; returns the manifest."""
        plan_sha = plan_sha256(plan)
        if existing and existing.get("plan_sha256") != plan_sha and (
                existing.get("plan_hash") == PLAN_HASH or existing.get("plan_sha256") != legacy_plan_sha256(plan)):
            raise SweepInputError(f"{self.out_dir}: the plan for the current devices differs from the recorded "
                                  "one (devices changed?); resume needs the same devices")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        manifest = {
            "schema_version": SCHEMA_VERSION, "sweep_id": sweep_id, "config": self.config.to_json(),
            "seeds": {"seed": self.config.seed, "input_seed": self.config.effective_input_seed,
                      "offset_seed": self.config.effective_offset_seed},
            "created": existing.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "driver": {"hostname": platform.node(), "python": platform.python_version(), "ray": ray.__version__,
                       "clock": "time.monotonic_ns (driver monotonic)"},
            "agents": {k: {**probes[k], "clock_offset_ns": o.offset_ns, "clock_uncertainty_ns": o.uncertainty_ns}
                       for k, o in offsets.items()},
            "plan_sha256": plan_sha, "plan_hash": PLAN_HASH, "planned_trials": len(plan), "status": "running",
            "resumed": existing.get("resumed", 0) + (1 if self.resume else 0),
        }
        write_json_atomic(self.out_dir / sinks.MANIFEST, manifest)
        if not (self.out_dir / sinks.PLAN_FILE).exists():
            plan_table = plan_table_of(plan)
            write_atomic(self.out_dir / sinks.PLAN_FILE, lambda tmp: pq.write_table(plan_table, tmp))
        return manifest

    def _prior_reference_rows(self, done_ids: set[str]) -> dict[str, list[dict]]:
        """Reference rows already on disk, keyed by device key (for --resume)."""
        plan = pq.read_table(self.out_dir / sinks.PLAN_FILE, columns=["trial_id", "device"]).to_pylist()
        device_of = {r["trial_id"]: r["device"] for r in plan}
        table = sinks.read_table(
            self.out_dir, columns=["trial_id", "trial_kind", "workload", "mechanism", "outcome", "duration_ms",
                                   "phase_timeline_json", "t_start_ns", "t_handback_ns"],
            filter=pa.compute.field("trial_kind") == "reference")
        out: dict[str, list[dict]] = collections.defaultdict(list)
        for r in table.to_pylist():
            if r["trial_id"] in device_of:
                out[device_of[r["trial_id"]]].append(r)
        return out


class _Stopping(Exception):
    """Raised in a device thread by the record callback: the sweep takes no more trials."""


def _kill_agents(agents: dict) -> None:
    for a in agents.values():
        try:
            ray.kill(a)
        except Exception:
            pass


def _run_in_parallel(runs: list[DeviceRun], result: SweepResult, errors: list[BaseException],
                     stop: threading.Event | None = None, on_interrupt=None, grace_s: float = 30.0) -> None:
    """Every device on the driver's event loop (``device_run.run_devices``, its own thread); an
    exception is kept and raised after every device finished.

    Interrupted (a signal in this, the main thread): ``stop`` is set, so no record is taken
    any more and the loop cancels the devices at their next await, ``on_interrupt`` ends the
    agents (their trials in flight fail at once), and the loop is given ``grace_s`` to leave
    before the interrupt goes on; no device prints or records on the way out.
    """
    stop = stop if stop is not None else threading.Event()

    def on_done(run: DeviceRun, outcome) -> None:
        if isinstance(outcome, BaseException):
            errors.append(outcome)
            return
        result.not_run.extend(outcome)
        result.stopped.extend([run.stopped] if run.stopped else [])

    loop_thread = run_devices(runs, on_done, stop)
    try:
        while loop_thread.is_alive():
            loop_thread.join(timeout=0.5)
    except BaseException:
        stop.set()
        if on_interrupt is not None:
            on_interrupt()
        loop_thread.join(timeout=grace_s)
        raise


def run_sweep(config: SweepConfig, out_dir: Path, **kwargs) -> SweepResult:
    """Python API: run a sweep (from a notebook, another Ray job, or the CLI)."""
    return Sweep(config, out_dir, **kwargs).run()
