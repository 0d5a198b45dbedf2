"""The sweep driver: validate, plan, start agents, deliver cancels, sink records.

Side effects live here (Ray, files); planning and record maths are pure
functions in plan.py and schema.py.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import platform
import statistics
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import ray

from cancelbench.datasets.locks import LockError, load_lock, verify_file
from cancelbench.device_agents.model_check import ModelMismatchError, check_workload_files

from cancelbench import sink as sinks

from . import cluster
from .clock import ClockOffset, driver_now_ns, estimate_offset
from .config import SweepConfig, WorkloadSpec, load_inputs
from .plan import ReferenceTimeline, TrialSpec, build_plan, resolve_offset_ms
from cancelbench.schema import SCHEMA_VERSION, derive, empty_row


class SweepInputError(ValueError):
    """Bad input discovered before any trial ran (exit code 2)."""


class ReferencesFailed(RuntimeError):
    """No reference run of a cell completed: its cancel trials would all fail the same way."""


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

    @property
    def failures(self) -> int:
        return sum(self.outcomes[k] + self.prior_outcomes[k] for k in ("dropped", "lost", "error"))

    @property
    def exit_code(self) -> int:
        return 1 if self.failures or self.stopped else 0


def _unwrap(exc: BaseException) -> str:
    """One line from an exception raised on an agent (Ray wraps it)."""
    cause = getattr(exc, "cause", None) or exc.__cause__ or exc
    text = f"{type(cause).__name__}: {cause}" if cause is not exc else str(exc)
    return text.strip().splitlines()[-1] if text.strip() else type(exc).__name__


def workload_payload(wl: WorkloadSpec, driver_sees_files: bool = False) -> dict:
    """Engine parameters plus the lock entries the agent verifies before loading.

    With ``driver_sees_files`` (a local cluster) model files are verified here,
    before Ray starts; on a remote cluster each agent verifies its own copy.
    """
    payload = wl.engine_params()
    locks: dict = {}
    for key in ("model", "mmproj"):
        spec = getattr(wl, key)
        if not spec or wl.engine == "probe":
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
            verify_file(path, entries[path.name])
        e = entries[path.name]
        locks[path.name] = {"size": e.size, "sha256": e.sha256, "source": e.source}
    payload["locks"] = locks
    if wl.engine == "probe":
        payload.pop("model", None)
        payload.pop("mmproj", None)
    return payload


def _reference_timeline(rows: list[dict]) -> ReferenceTimeline | None:
    done = [r for r in rows if r.get("outcome") == "completed" and r.get("duration_ms") is not None]
    if not done:
        return None
    done.sort(key=lambda r: r["duration_ms"])
    median = done[len(done) // 2]
    segs = tuple(tuple(s) for s in json.loads(median.get("phase_timeline_json") or "[]"))
    return ReferenceTimeline(duration_ms=statistics.median(r["duration_ms"] for r in done), segments=segs)


def _sleep_until_driver(deadline_ns: int) -> None:
    while True:
        left = deadline_ns - driver_now_ns()
        if left <= 0:
            return
        if left > 2_000_000:
            time.sleep((left - 1_000_000) / 1e9)


class _Progress:
    """One progress bar per device: trials done, dropped so far, ETA (tqdm)."""

    def __init__(self, totals: dict[str, int], enabled: bool) -> None:
        self.bars = {}
        self.dropped = collections.Counter()
        if enabled:
            import sys

            from tqdm import tqdm
            interval = 0.5 if sys.stderr.isatty() else 30.0  # a log file gets a line every 30 s
            for i, (key, total) in enumerate(sorted(totals.items())):
                self.bars[key] = tqdm(total=total, desc=key, position=i, unit="trial", leave=True,
                                      dynamic_ncols=True, mininterval=interval)

    def update(self, key: str, outcome: str) -> None:
        if outcome == "dropped":
            self.dropped[key] += 1
        bar = self.bars.get(key)
        if bar is not None:
            bar.set_postfix(dropped=self.dropped[key], refresh=False)
            bar.update(1)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


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
            items = load_inputs(wl) if wl.engine != "probe" else [{"id": "busy", "text": ""}]
            inputs[wl.name] = {str(it["id"]): it for it in items}
        try:
            local = not (self.address or os.environ.get("RAY_ADDRESS"))
            payloads = {wl.name: workload_payload(wl, driver_sees_files=local) for wl in self.config.workloads}
            for wl in self.config.workloads:  # architecture vs engine, for the files this driver sees
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
        elif manifest_path.exists() or sinks.records_dir(self.out_dir).exists():
            raise SweepInputError(f"{self.out_dir} already holds a sweep; use --resume to continue it "
                                  "or choose another --out directory")
        return inputs, payloads, existing or {}

    def run(self) -> SweepResult:
        with sinks.locked_output(self.out_dir):  # one sweep per --out at a time
            return self._run_locked()

    def _run_locked(self) -> SweepResult:
        inputs, payloads, existing = self._validate()
        cluster.connect(self.address)
        try:
            slots = cluster.discover_slots(self.config.devices)
        except cluster.ClusterError as exc:
            raise SweepInputError(str(exc)) from None
        n_threads = max(w.n_threads for w in self.config.workloads)
        sweep_id = existing.get("sweep_id") or f"sw-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        # Named, so an operator (or a test) can find a sweep's agents: cancelbench/<sweep>/<host>/<device>.
        agents = {s.key: cluster.start_agent(s, n_threads, self.max_restarts, name=f"{sweep_id}/{s.key}")
                  for s in slots}
        try:
            return self._run(sweep_id, slots, agents, inputs, payloads, existing)
        finally:
            for a in agents.values():
                try:
                    ray.kill(a)
                except Exception:
                    pass

    def _run(self, sweep_id, slots, agents, inputs, payloads, existing) -> SweepResult:
        slot_by_key = {s.key: s for s in slots}
        probes = {k: v for k, v in zip(agents, ray.get([a.probe.remote() for a in agents.values()]))}
        try:
            cluster.check_agents([slot_by_key[k] for k in probes], list(probes.values()))
        except cluster.ClusterError as exc:
            raise SweepInputError(str(exc)) from None
        # Load every workload once up front: a bad model is an input error before any trial.
        for key, agent in agents.items():
            for wl in self.config.workloads:
                try:
                    ray.get(agent.load.remote(payloads[wl.name]))
                except ray.exceptions.RayTaskError as exc:
                    raise SweepInputError(f"{key}: workload {wl.name}: {_unwrap(exc)}") from None
        offsets = {k: estimate_offset(lambda a=a: ray.get(a.ping.remote()), self.config.ping_samples)
                   for k, a in agents.items()}
        plan = build_plan(self.config, list(agents), {n: list(v) for n, v in inputs.items()})
        self.out_dir.mkdir(parents=True, exist_ok=True)
        plan_table = pa.Table.from_pylist([t.to_dict() for t in plan])
        plan_sha = hashlib.sha256(json.dumps([t.to_dict() for t in plan], sort_keys=True).encode()).hexdigest()
        if existing and existing.get("plan_sha256") != plan_sha:
            raise SweepInputError(f"{self.out_dir}: the plan for the current devices differs from the recorded "
                                  "one (devices changed?); resume needs the same devices")
        done_ids = sinks.completed_trial_ids(self.out_dir) if self.resume else set()
        prior_outcomes = sinks.outcome_counts(self.out_dir) if done_ids else collections.Counter()
        manifest = {
            "schema_version": SCHEMA_VERSION, "sweep_id": sweep_id, "config": self.config.to_json(),
            "seeds": {"seed": self.config.seed, "input_seed": self.config.effective_input_seed,
                      "offset_seed": self.config.effective_offset_seed},
            "created": existing.get("created") or time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "driver": {"hostname": platform.node(), "python": platform.python_version(), "ray": ray.__version__,
                       "clock": "time.monotonic_ns (driver monotonic)"},
            "agents": {k: {**probes[k], "clock_offset_ns": o.offset_ns, "clock_uncertainty_ns": o.uncertainty_ns}
                       for k, o in offsets.items()},
            "plan_sha256": plan_sha, "planned_trials": len(plan), "status": "running",
            "resumed": existing.get("resumed", 0) + (1 if self.resume else 0),
        }
        sinks.write_json_atomic(self.out_dir / sinks.MANIFEST, manifest)
        if not (self.out_dir / sinks.PLAN_FILE).exists():
            tmp = self.out_dir / f".{sinks.PLAN_FILE}.tmp"
            pq.write_table(plan_table, tmp)
            tmp.replace(self.out_dir / sinks.PLAN_FILE)

        sink = sinks.RecordSink(self.out_dir)
        result = SweepResult(self.out_dir, sweep_id, planned=len(plan), written=0, prior_outcomes=prior_outcomes)
        by_device: dict[str, list[TrialSpec]] = collections.defaultdict(list)
        for t in plan:
            by_device[t.device].append(t)
        prior_refs = self._prior_reference_rows(done_ids) if done_ids else {}
        todo = {k: [t for t in ts if t.trial_id not in done_ids] for k, ts in by_device.items()}
        progress = _Progress({k: len(v) for k, v in todo.items()}, self.show_progress)
        lock = threading.Lock()

        def record(key: str, row: dict) -> None:
            sink.add(row)
            with lock:
                result.outcomes[row["outcome"]] += 1
                result.written += 1
            progress.update(key, row["outcome"])

        threads = []
        errors: list[BaseException] = []
        for key, trials in todo.items():
            ctx = _DeviceRun(self, key, slot_by_key[key], agents[key], trials, inputs, payloads, offsets[key],
                             sweep_id, prior_refs.get(key, []), record)

            def target(ctx=ctx):
                try:
                    result.not_run.extend(ctx.run())
                    result.stopped.extend([ctx.stopped] if ctx.stopped else [])
                except BaseException as exc:  # surfaced after the other devices finish
                    errors.append(exc)

            th = threading.Thread(target=target, name=f"device-{key}", daemon=True)
            th.start()
            threads.append(th)
        interrupted = False
        try:
            for th in threads:
                while th.is_alive():
                    th.join(timeout=0.5)
        except BaseException:  # KeyboardInterrupt (SIGINT): the dataset is partial
            interrupted = True
            raise
        finally:
            try:
                sink.close()  # raises SinkError if records had to be kept as JSON lines
            finally:
                progress.close()
                manifest["status"] = ("interrupted" if interrupted else
                                      "complete" if not result.not_run and not errors and not sink.last_error
                                      else "incomplete")
                manifest["not_run"] = sorted(result.not_run)
                sinks.write_json_atomic(self.out_dir / sinks.MANIFEST, manifest)
        if errors:
            raise errors[0]
        return result

    def _prior_reference_rows(self, done_ids: set[str]) -> dict[str, list[dict]]:
        """Reference rows already on disk, keyed by device key (for --resume)."""
        plan = pq.read_table(self.out_dir / sinks.PLAN_FILE, columns=["trial_id", "device"]).to_pylist()
        device_of = {r["trial_id"]: r["device"] for r in plan}
        table = sinks.open_dataset(self.out_dir).to_table(
            columns=["trial_id", "trial_kind", "workload", "mechanism", "outcome", "duration_ms",
                     "phase_timeline_json"], filter=pa.compute.field("trial_kind") == "reference")
        out: dict[str, list[dict]] = collections.defaultdict(list)
        for r in table.to_pylist():
            if r["trial_id"] in device_of:
                out[device_of[r["trial_id"]]].append(r)
        return out


class _DeviceRun:
    """Runs one device's trials in plan order, one at a time."""

    def __init__(self, sweep: Sweep, key, slot, agent, trials, inputs, payloads, offset: ClockOffset, sweep_id,
                 prior_refs, record) -> None:
        self.sweep, self.key, self.slot, self.agent = sweep, key, slot, agent
        self.trials, self.inputs, self.payloads, self.offset = trials, inputs, payloads, offset
        self.sweep_id, self.record = sweep_id, record
        self.refs: dict[tuple[str, str], list[dict]] = collections.defaultdict(list)
        for r in prior_refs:
            self.refs[(r["workload"], r["mechanism"])].append(r)
        self.loaded: dict | None = None
        self.loaded_name: str | None = None
        self.last_phase: str | None = None  # last phase seen by status polls during a trial
        self.stopped: str | None = None  # why this device stopped early
        self.config = sweep.config

    def run(self) -> list[str]:
        for i, trial in enumerate(self.trials):
            try:
                self._ensure_loaded(trial.workload)
                self.record(self.key, self._run_trial(trial))
            except ray.exceptions.ActorUnschedulableError:
                # Its node is gone: this trial and the rest cannot run on this device.
                return [t.trial_id for t in self.trials[i:]]
            except ReferencesFailed as exc:
                self.stopped = f"{exc}; stopped before {len(self.trials) - i} trial(s) (listed as not_run)"
                return [t.trial_id for t in self.trials[i:]]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as exc:
                self.record(self.key, self._lost_row(trial, exc))
                if not self._await_restart():
                    return [t.trial_id for t in self.trials[i + 1:]]
        return []

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

    def _base_row(self, trial: TrialSpec) -> dict:
        wl = next(w for w in self.config.workloads if w.name == trial.workload)
        payload = self.payloads[trial.workload]
        info = self.loaded or {}
        model = Path(wl.model).name if wl.engine != "probe" else "probe"
        lock = next(iter(payload.get("locks", {}).values()), {}) if wl.engine != "probe" else {}
        row = empty_row()
        row.update(
            sweep_id=self.sweep_id, trial_id=trial.trial_id, trial_index=trial.trial_index,
            trial_kind=trial.trial_kind, seed=self.config.seed, input_seed=trial.input_seed,
            offset_seed=trial.offset_seed, workload=trial.workload, engine=wl.engine,
            model=model.replace("fixture:", ""), model_sha256=lock.get("sha256"),
            n_ctx=info.get("n_ctx"), n_batch=info.get("n_batch", wl.n_batch), n_ubatch=info.get("n_ubatch", wl.n_ubatch),
            chunk_tokens=info.get("chunk_tokens", wl.chunk_tokens), max_tokens=info.get("max_tokens", wl.max_tokens),
            n_gpu_layers=info.get("n_gpu_layers", wl.n_gpu_layers), input_id=trial.input_id,
            mechanism=trial.mechanism, delivery=trial.delivery, offset_plan=trial.offset_plan,
            offset_fraction=trial.offset_fraction, target_phase=trial.target_phase,
            clock_offset_ns=self.offset.offset_ns, clock_uncertainty_ns=self.offset.uncertainty_ns,
            host=self.slot.host, backend=self.slot.backend, device=self.slot.device_id,
        )
        return row

    def _run_trial(self, trial: TrialSpec) -> dict:
        row = self._base_row(trial)
        item = self.inputs[trial.workload][trial.input_id]
        spec = {"trial_id": trial.trial_id, "input_id": trial.input_id, "mechanism": trial.mechanism,
                "delivery": trial.delivery, "seed": self.config.seed, "input": item.get("text", ""),
                "wav": item.get("wav"), "lang": item.get("lang")}
        if trial.trial_kind == "reference" and self.engine_of(trial.workload) == "tts":
            # An uncancelled synthesis is kept so a person can listen to it.
            spec["wav_out"] = str((self.sweep.out_dir / "audio" / f"{trial.trial_id}.wav").resolve())
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
                row.update(outcome="error", error=str(exc))
                return derive(row)
            row["offset_target_ms"] = target_ms
            row["reference_ms"] = timeline.duration_ms if timeline else None
            if trial.delivery == "agent":
                spec["offset_ms"] = target_ms
        issue: dict = {}
        t_sub = driver_now_ns()
        ref = self.agent.run_trial.remote(spec)
        cancel_ref = None
        if trial.trial_kind == "cancel" and trial.delivery == "driver":
            scheduled = t_sub + int(target_ms * 1e6)
            _sleep_until_driver(scheduled)
            issued = driver_now_ns()
            cancel_ref = self.agent.cancel.remote(trial.trial_id)
            issue = {"t_issued_driver_ns": issued, "t_issued_ns": self.offset.to_agent(issued),
                     "t_cancel_scheduled_ns": self.offset.to_agent(scheduled)}
        self.last_phase = None
        while not ray.wait([ref], timeout=0.5)[0]:
            # Long trial: note its phase, so a trial lost to an agent death says where it died.
            try:
                self.last_phase = ray.get(self.agent.status.remote(), timeout=2).get("phase")
            except Exception:
                break
        agent_row = ray.get(ref)
        reply = ray.get(cancel_ref) if cancel_ref is not None else None
        row.update({k: v for k, v in agent_row.items() if v is not None or k not in row})
        row.update(issue)
        if reply is not None and row["outcome"] == "completed" and reply["state"] != "finished":
            # The agent took the cancel while the trial was pending or running, yet
            # the engine ran to completion: the cancel was dropped on the way.
            row["outcome"] = "dropped"
        if trial.delivery == "agent":
            row["clock_uncertainty_ns"] = 0  # issued on the agent's own clock
        derive(row)
        if trial.trial_kind == "reference":
            self.refs[ref_key].append(row)
        return row

    def _lost_row(self, trial: TrialSpec, exc: BaseException) -> dict:
        row = self._base_row(trial)
        row.update(outcome="lost", phase_at_terminal=self.last_phase,
                   error=f"agent died during the trial: {_unwrap(exc)}"[:2000])
        return derive(row)


def run_sweep(config: SweepConfig, out_dir: Path, **kwargs) -> SweepResult:
    """Python API: run a sweep (from a notebook, another Ray job, or the CLI)."""
    return Sweep(config, out_dir, **kwargs).run()
