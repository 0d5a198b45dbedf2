"""The trial plan, generated whole before the run (MLPerf LoadGen style).

Pure functions only. Same config + same devices => the same plan, trial ids
included. Input choice and offsets draw from separate seeded streams, and each
cell (device, workload, mechanism, delivery) has its own stream, so adding a
device or a mechanism does not change the other cells' trials.

Offsets are planned as fractions where they depend on a device's own timeline
(``uniform``: of the reference duration; ``phase``: of the time the reference
run spent in the target phase) and resolved to ms per device once its
reference runs are in (``offsets.resolve_offset``: each offset plan draws and
resolves its own offsets, ``offsets.PLANS``).
"""

from __future__ import annotations

import hashlib
import json
import json.encoder
import operator
import re
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields

import numpy as np

from cancelbench.inputs import safe_component
from cancelbench.schema import NOT_APPLICABLE

from .config import SweepConfig
from .offsets import (MAX_STEP_FRACTION, ReferenceTimeline, Resolved, resolve_offset)  # noqa: F401 (their home moved)


@dataclass(frozen=True)
class TrialSpec:
    trial_id: str
    trial_index: int
    device: str  # device key: "<node label or host>/<device id>"
    workload: str
    trial_kind: str  # reference | cancel
    mechanism: str
    delivery: str  # driver | agent | NOT_APPLICABLE (reference)
    offset_plan: str
    input_id: str
    input_seed: int
    offset_seed: int
    offset_fraction: float | None = None
    offset_ms: float | None = None  # immediate / fixed
    target_phase: str | None = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


_FIELDS = tuple(f.name for f in fields(TrialSpec))


def _stream(seed: int, *parts: str) -> np.random.Generator:
    key = zlib.crc32("\x1f".join(parts).encode())
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, key])))


_DEVICE_ID = re.compile(r"([a-z]+):([0-9]+)")


def _id_part(text: str) -> str:
    """A name as one part of a trial id, injectively (see :func:`cancelbench.inputs.safe_component`)."""
    return safe_component(text)


def device_id_part(device: str) -> str:
    """A device key ``<host>/<backend>:<index>`` as a trial-id part: ``<host part>_<backend>_<index>``.

    The host part is :func:`_id_part` of the host (kept, or cut and hashed), and
    the backend and index are read back from the right, so two distinct device
    keys never share a part. A key of another form is hashed whole.
    """
    host, _, dev = device.rpartition("/")
    m = _DEVICE_ID.fullmatch(dev)
    if not host or m is None:
        return _id_part(device)
    return f"{_id_part(host)}_{m.group(1)}_{m.group(2)}"


class Trials(Sequence):
    """Some rows of a plan, in plan order, as :class:`TrialSpec` made when read (a plan of a
    million trials is not a million objects before the first trial runs)."""

    def __init__(self, columns: dict[str, list], rows: Sequence[int]) -> None:
        self.columns, self.rows = columns, rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return Trials(self.columns, self.rows[i])
        r = self.rows[i]
        return _spec(tuple(self.columns[f][r] for f in _FIELDS))

    def __iter__(self) -> Iterator[TrialSpec]:
        cols = [self.columns[f] for f in _FIELDS]
        if isinstance(self.rows, range) and self.rows == range(len(cols[0])):
            return map(_spec, zip(*cols))
        return (_spec(tuple(c[r] for c in cols)) for r in self.rows)

    def column(self, name: str) -> list:
        col = self.columns[name]
        return col if isinstance(self.rows, range) and self.rows == range(len(col)) else [col[r] for r in self.rows]


class Plan(Trials):
    """The whole trial plan, in run order: columns (field name -> list; what the plan's hash and
    ``plan.parquet`` are made from), read as :class:`TrialSpec` rows."""

    def __init__(self, columns: dict[str, list]) -> None:
        super().__init__(columns, range(len(columns["trial_id"])))

    def by_device(self, skip: set[str] = frozenset()) -> dict[str, Trials]:
        """Each device's trials not in ``skip``, in plan order."""
        rows: dict[str, list[int]] = {}
        for r, (tid, dev) in enumerate(zip(self.columns["trial_id"], self.columns["device"])):
            if tid not in skip:
                rows.setdefault(dev, []).append(r)
        return {dev: Trials(self.columns, rs) for dev, rs in rows.items()}


def build_plan(config: SweepConfig, devices: list[str], inputs: dict[str, list[str]]) -> Plan:
    """Every trial of the sweep: per device and workload, references then interleaved cancels.

    ``devices``: device keys; ``inputs``: workload name -> input ids (corpus order).

    Built a column at a time: one vectorized draw per seeded stream (the same
    values as one draw per trial), the interleaving applied to whole columns,
    and each TrialSpec made once, with its final index, from its row.
    """
    cols: dict[str, list] = {f: [] for f in _FIELDS}
    in_seed, off_seed = config.effective_input_seed, config.effective_offset_seed
    offsets = config.offsets
    for device in sorted(devices):
        backend = device.rsplit("/", 1)[-1].split(":", 1)[0]
        dev_part = device_id_part(device)
        for wl in config.workloads:
            if wl.backends and backend not in wl.backends:
                continue
            wl_part = _id_part(wl.name)
            ids = inputs[wl.name]
            phases = offsets.target_phases(wl.spec)
            # References first (offsets need them) ...
            _references(cols, config, device, f"{dev_part}.{wl_part}", wl.name, ids)
            # ... then the workload's cells interleaved, so slow drift on the host does not bias one
            # cell. The model is loaded once per workload.
            c_id, c_mech, c_deliv, c_input, c_frac, c_ms, c_phase = [], [], [], [], [], [], []
            for mech in config.mechanisms:
                for delivery in config.deliveries:
                    rin = _stream(in_seed, device, wl.name, mech, delivery)
                    roff = _stream(off_seed, device, wl.name, mech, delivery)
                    n = offsets.cancels_per_cell(config.trials_per_cell, wl.spec)
                    prefix = f"{dev_part}.{wl_part}.{mech}.{delivery}."
                    c_id += [f"{prefix}{k:04d}" for k in range(n)]
                    c_mech += [mech] * n
                    c_deliv += [delivery] * n
                    c_input += map(ids.__getitem__, rin.integers(len(ids), size=n).tolist())
                    drawn = offsets.kind.draw(offsets, roff, n, phases)
                    c_frac += drawn.fractions
                    c_ms += drawn.ms
                    c_phase += drawn.phases
            n = len(c_id)
            if n:
                order = _stream(config.seed, device, wl.name, "order").permutation(n).tolist()
                pick = operator.itemgetter(*order) if n > 1 else (lambda col: (col[0],))
                _extend(cols, n, trial_id=pick(c_id), device=device, workload=wl.name, trial_kind="cancel",
                        mechanism=pick(c_mech), delivery=pick(c_deliv), offset_plan=offsets.plan,
                        input_id=pick(c_input), input_seed=in_seed, offset_seed=off_seed,
                        offset_fraction=pick(c_frac), offset_ms=pick(c_ms), target_phase=pick(c_phase))
    cols["trial_index"] = list(range(len(cols["trial_id"])))
    return Plan(cols)


def _references(cols: dict[str, list], config: SweepConfig, device: str, prefix: str, workload: str,
                ids: list[str]) -> None:
    """A workload's reference runs on one device: reference_runs per mechanism, inputs drawn."""
    n_refs, in_seed = config.reference_runs, config.effective_input_seed
    ref_id, ref_mech, ref_input = [], [], []
    for mech in config.mechanisms:
        rin = _stream(in_seed, device, workload, mech, "reference")
        ref_id += [f"{prefix}.{mech}.ref.{r:03d}" for r in range(n_refs)]
        ref_mech += [mech] * n_refs
        ref_input += [ids[int(rin.integers(len(ids)))] for _ in range(n_refs)]
    _extend(cols, len(ref_id), trial_id=ref_id, device=device, workload=workload, trial_kind="reference",
            mechanism=ref_mech, delivery=NOT_APPLICABLE, offset_plan=NOT_APPLICABLE, input_id=ref_input,
            input_seed=in_seed, offset_seed=config.effective_offset_seed, offset_fraction=None, offset_ms=None,
            target_phase=None)


def _extend(cols: dict[str, list], n: int, **values) -> None:
    """Append ``n`` rows: a list/tuple value is the column's n values, anything else is repeated."""
    for f, v in values.items():
        cols[f] += v if isinstance(v, (list, tuple)) else [v] * n


_new = object.__new__


def _spec(row: tuple) -> TrialSpec:
    """A TrialSpec from its row, without the frozen dataclass's per-field ``object.__setattr__``."""
    t = _new(TrialSpec)
    t.__dict__.update(zip(_FIELDS, row))
    return t


def planned_trials(config: SweepConfig, devices: list[str]) -> int:
    """How many trials :func:`build_plan` makes for these devices, without building the plan."""
    n_mech = len(config.mechanisms)
    total = 0
    for device in devices:
        backend = device.rsplit("/", 1)[-1].split(":", 1)[0]
        for wl in config.workloads:
            if wl.backends and backend not in wl.backends:
                continue
            per_cell = config.offsets.cancels_per_cell(config.trials_per_cell, wl.spec)
            total += n_mech * (config.reference_runs + len(config.deliveries) * per_cell)
    return total


PLAN_HASH = "columns-v1"  # the manifest's plan_hash: how plan_sha256 was computed


def plan_sha256(plan: Sequence[TrialSpec]) -> str:
    """sha256 of the plan's columns, in field order: numbers as float64/int64 bytes (None as NaN),
    text NUL-joined (None as \\x01; names never hold control characters), each column tagged
    with its name and length."""
    h = hashlib.sha256(PLAN_HASH.encode())
    for f, col in plan_columns(plan).items():
        h.update(f"\x1e{f}\x1f{len(col)}\x1f".encode())
        h.update(_column_bytes(col))
    return h.hexdigest()


def _column_bytes(col: list) -> bytes:
    first = next((v for v in col if v is not None), None)
    if first is None:
        return b"N"
    if isinstance(first, str):
        text = "\x00".join(col) if None not in col else "\x00".join("\x01" if v is None else v for v in col)
        return b"S" + text.encode("utf-8", "surrogatepass")
    if isinstance(first, float) or None in col:
        return b"F" + np.array(col, dtype=np.float64).tobytes()
    return b"I" + np.array(col, dtype=np.int64).tobytes()


def legacy_plan_sha256(plan: list[TrialSpec]) -> str:
    """The plan hash of datasets written before ``plan_hash`` (issue 17): the sha256 of
    ``json.dumps([t.to_dict() for t in plan], sort_keys=True)``, streamed (so --resume of such a
    dataset still recognizes its plan). Built a trial at a time with the C string encoder instead
    of one whole-plan string and a dict per trial."""
    h = hashlib.sha256()
    h.update(b"[")
    enc = _json_str
    batch: list[str] = []
    for t in plan:
        d = t.__dict__
        batch.append(_TRIAL_JSON % (
            enc(d["delivery"]), enc(d["device"]), enc(d["input_id"]), _json_num(d["input_seed"]),
            enc(d["mechanism"]), _json_num(d["offset_fraction"]), _json_num(d["offset_ms"]), enc(d["offset_plan"]),
            _json_num(d["offset_seed"]), _json_opt(d["target_phase"]), enc(d["trial_id"]),
            _json_num(d["trial_index"]), enc(d["trial_kind"]), enc(d["workload"])))
        if len(batch) >= 4096:
            h.update(", ".join(batch).encode())
            batch = [""]  # the next batch starts with a separator
    h.update(", ".join(batch).encode())
    h.update(b"]")
    return h.hexdigest()


_TRIAL_JSON = ('{"delivery": %s, "device": %s, "input_id": %s, "input_seed": %s, "mechanism": %s, '
               '"offset_fraction": %s, "offset_ms": %s, "offset_plan": %s, "offset_seed": %s, '
               '"target_phase": %s, "trial_id": %s, "trial_index": %s, "trial_kind": %s, "workload": %s}')
_json_str = json.encoder.encode_basestring_ascii  # what json.dumps uses (ensure_ascii)


def _json_num(v) -> str:
    return "null" if v is None else json.encoder.encode_basestring_ascii(v) if isinstance(v, str) else (
        float.__repr__(v) if isinstance(v, float) else int.__repr__(v))


def _json_opt(v) -> str:
    return "null" if v is None else _json_str(v)


def plan_table(plan: Sequence[TrialSpec]):
    """The plan as a pyarrow table (``plan.parquet``), with explicit column types (no inference)."""
    import pyarrow as pa

    types = {"trial_index": pa.int64(), "input_seed": pa.int64(), "offset_seed": pa.int64(),
             "offset_fraction": pa.float64(), "offset_ms": pa.float64()}
    types.update((f, pa.string()) for f in ("trial_id", "device", "workload", "trial_kind", "mechanism",
                                            "delivery", "offset_plan", "input_id", "target_phase"))
    cols = plan_columns(plan)
    return pa.table({f: pa.array(cols[f], type=types.get(f)) for f in _FIELDS})  # another field: inferred


def plan_columns(plan: Sequence[TrialSpec]) -> dict[str, list]:
    """The plan as columns (for plan.parquet and its hash)."""
    if isinstance(plan, Trials):
        return {f: plan.column(f) for f in _FIELDS}
    return {f: [t.__dict__[f] for t in plan] for f in _FIELDS}
