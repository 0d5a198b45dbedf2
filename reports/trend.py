"""``cancelbench trend DIR [DIR...]``: one cell's latency across many sweeps.

Sweeps are ordered by ``--by``: ``created`` (the manifest's creation time),
``given`` (the order on the command line), or any record column, e.g.
``llama_cpp_build``, ``cancelbench_version``, ``llama_cpp_commit`` or a
settings column (the sweep's most common value; strings in natural order, so
``b10`` follows ``b9``).  Ties keep the command-line order.

Cells match across sweeps exactly as ``diff`` matches them (``diff._cells_by_class``:
workload, phase, mechanism, delivery, device class).  Per cell and sweep the
table shows n, the p50 and the bound percentile with 95% bootstrap intervals
(the exact order-statistic bootstrap of ``stats.bootstrap_percentiles``,
seeded per cell and sweep); each percentile only where n reaches its minimum
count (``stats.min_samples``: 5 for the p50, 299 for a p99 at 95%), and a step
is tested only where both sides have their p50.

Change between consecutive sweeps: a two-sided Mann-Whitney U test on the raw
latencies (``trend_stats``: the exact null distribution without ties, the
tie-corrected normal approximation otherwise; the tests cross-check it against
scipy), Holm-corrected over every test the trend makes (all cells x all consecutive pairs) at ``alpha`` (default
0.05).  A change is *flagged* when it is significant after correction and the
p50 moved by more than ``--threshold`` (default 10%): a statistically certain
1% shift is noise in practice.  Per cell, the first flagged sweep is named.

Exit 1 when the newest sweep regressed against the one before it, in any
cell: ``diff``'s verdict for that pair (new dropped/lost trials, newly over the
bound, a significant percentile increase) or a flagged p50 increase at the
last step.  Exit 2 on bad input.
"""

from __future__ import annotations

import glob
import math
import re
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from cancelbench.sink import DatasetError, read_manifest

from . import noise, stats
from .diff import DiffSpec, _cell_seed, _one_sided, attach_invalid, compare_cell, read_side
from .load import Filters, distinct_datasets
from .sections import fmt_ms
from .tables import BoundSpec, ReportSpec
from .trend_stats import _interval, _mwu_impl, fold_change, holm

SPECIAL_KEYS = ("created", "given")
MAX_TREND_PANELS = 36


class TrendInputError(DatasetError):
    pass


@dataclass(frozen=True)
class TrendSpec:
    by: str = "created"
    percentile: float = 0.99
    alpha: float = 0.05
    rel_threshold: float = 0.10
    confidence: float = stats.DEFAULT_CONFIDENCE
    n_boot: int = 2000
    seed: int = 0
    bound: BoundSpec = BoundSpec()
    noise: noise.NoiseSpec = noise.NoiseSpec()  # each sweep's host vs the previous one's (reports/noise.py)

    def diff_spec(self) -> DiffSpec:
        return DiffSpec(percentile=self.percentile, rel_threshold=self.rel_threshold, confidence=self.confidence,
                        n_boot=max(self.n_boot, 100), seed=self.seed, bound=self.bound)

    def report_spec(self) -> ReportSpec:
        return self.diff_spec().report_spec()


@dataclass
class SweepInfo:
    index: int
    path: str
    key: str  # the --by value, as text
    created: str
    sweep_id: str
    builds: dict[str, dict[str, str]] = field(default_factory=dict)  # device class -> build facts
    invalid_records: int = 0  # records that cannot be trusted (load.invalid_records): the trend fails


@dataclass
class TrendPoint:
    n: int
    p50: float | None
    p50_ci: tuple[float, float] | None
    high: float | None  # the bound percentile; None below its minimum count
    high_ci: tuple[float, float] | None
    dropped: int
    lost: int
    over: bool


@dataclass
class Step:
    """The change from sweep ``index - 1`` to sweep ``index``."""

    index: int
    p_value: float
    p_holm: float = 1.0
    rel_change: float | None = None  # of the p50
    flagged: bool = False

    @property
    def direction(self) -> str:
        return "up" if (self.rel_change or 0.0) > 0 else "down"


@dataclass
class TrendCell:
    workload: str
    phase: str
    mechanism: str
    delivery: str
    device_class: str
    points: list[TrendPoint | None]
    steps: list[Step | None]  # steps[i] compares sweep i-1 with sweep i; steps[0] is None
    first_flag: int | None = None
    newest_verdict: str = ""  # diff's verdict, newest vs previous sweep
    newest_reasons: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return (self.workload, self.phase, self.mechanism, self.delivery, self.device_class)

    @property
    def regressed(self) -> bool:
        return self.newest_verdict == "regressed"


@dataclass
class TrendResult:
    spec: TrendSpec
    sweeps: list[SweepInfo]
    cells: list[TrendCell]
    n_tests: int
    mwu: str  # which Mann-Whitney implementation ran
    samples: dict[tuple, list[np.ndarray | None]] = field(default_factory=dict, repr=False)
    notes: list[str] = field(default_factory=list)  # datasets counted once; invalid records outside every cell
    invalid: int = 0  # invalid records in all sweeps
    # noise[i]: sweep i's host against sweep i-1's (noise[0] is None); the newest pair's decides
    noise: list[noise.NoiseCheck | None] = field(default_factory=list)

    @property
    def regressed(self) -> list[TrendCell]:
        return [c for c in self.cells if c.regressed]

    @property
    def newest_noise(self) -> noise.NoiseCheck | None:
        return self.noise[-1] if self.noise else None

    @property
    def exit_code(self) -> int:
        if self.newest_noise is not None and self.newest_noise.refused:
            return noise.REFUSED_EXIT
        return 1 if self.regressed or self.invalid else 0


# ------------------------------------------------------------------ ordering --
def natural_key(text: str) -> tuple:
    """``b9`` < ``b10``; numbers compare as numbers inside strings."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in re.split(r"(\d+)", text) if t)


def expand_dirs(patterns: list[str], warn=None) -> list[str]:
    """Directories and globs (quoted globs reach us unexpanded), each directory once, in the order given.
    A glob match that is no sweep dataset (no manifest.json: a stray file, a notes folder) is skipped
    with a ``warn(line)``; a directory named outright is kept (and refused later if it is no dataset)."""
    out: list[str] = []
    for pat in patterns:
        matches = sorted(glob.glob(pat)) if glob.has_magic(pat) else [pat]
        if not matches:
            raise TrendInputError(f"{pat}: no directory matches")
        if glob.has_magic(pat):
            stray = [m for m in matches if not (Path(m) / "manifest.json").is_file()]
            for m in stray:
                if warn is not None:
                    warn(f"{m} (matched by {pat}): not a sweep dataset (no manifest.json); skipped")
            matches = [m for m in matches if m not in stray]
            if not matches:
                raise TrendInputError(f"{pat}: matches no sweep dataset (only {', '.join(stray[:3])}"
                                      f"{' ...' if len(stray) > 3 else ''})")
        for m in matches:
            if m not in out:
                out.append(m)
    return out


def _sweep_key(table, path: str, by: str, index: int) -> tuple[tuple, str]:
    """(sort key, the value as text) of one sweep; ``table``: its scanned rows (with the ``by`` column)."""
    if by == "given":
        return (index,), str(index + 1)
    if by == "created":
        created = str(read_manifest(Path(path)).get("created") or "")
        try:
            return (datetime.strptime(created, "%Y-%m-%dT%H:%M:%S%z").timestamp(),), created
        except ValueError:
            return (float("inf"),), created or "(unknown)"
    values = [v for v in table.column(by).to_pylist() if v is not None]
    if not values:
        raise TrendInputError(f"{path}: column {by!r} is null in every record (cannot order by it)")
    counts: dict = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    value = max(sorted(counts, key=str), key=lambda v: counts[v])  # most common; ties: smallest text
    if isinstance(value, (int, float)):
        return (0, float(value)), f"{value:g}" if isinstance(value, float) else str(value)
    return (1, natural_key(str(value))), str(value)


# ---------------------------------------------------------------------- build --
def _load_sweeps(dirs: list[str], spec: TrendSpec, filters: Filters) -> tuple[list[SweepInfo], list[dict], list]:
    """The sweeps in ``--by`` order (each dataset once, however named), each read once: its cells
    keyed as diff keys them, its builds and invalid records; and the notes on repeated datasets."""
    from cancelbench.schema import COLUMNS

    dirs, repeats = distinct_datasets(expand_dirs(dirs))
    if len(dirs) < 2:
        raise TrendInputError(f"a trend needs at least two sweeps, got {len(dirs)}"
                              + (f" ({'; '.join(map(str, repeats))})" if repeats else ""))
    if spec.by not in SPECIAL_KEYS and spec.by not in COLUMNS:
        raise TrendInputError(f"--by {spec.by!r}: not 'created', 'given' or a record column")
    rspec = spec.report_spec()
    extra = () if spec.by in SPECIAL_KEYS else (spec.by,)
    loaded = []
    for i, d in enumerate(dirs):
        side, table = read_side([d], rspec, filters, {}, extra)
        loaded.append((_sweep_key(table, str(d), spec.by, i), i, str(d), side))
        del table
    loaded.sort(key=lambda t: (t[0][0], t[1]))
    sweeps = []
    for pos, ((_, text), _, d, side) in enumerate(loaded):
        manifest = read_manifest(Path(d))
        sweeps.append(SweepInfo(pos, d, text, str(manifest.get("created") or ""), str(manifest.get("sweep_id") or ""),
                                side.builds, sum(len(v) for v in side.invalid.values())))
    return sweeps, [t[3] for t in loaded], repeats


def _point(side, key: tuple, i: int, spec: TrendSpec) -> tuple[TrendPoint | None, np.ndarray | None]:
    """One cell in one sweep: n, p50 and the bound percentile with their intervals, each only
    from the sample count it needs (as the report)."""
    s = side.get(key)
    if s is None:
        return None, None
    lat, st = s.sorted_latency, s.stats
    rng = np.random.default_rng(_cell_seed(spec.seed, (*key, i)))
    p50 = stats.nearest_rank(lat, 0.5) if len(lat) >= stats.min_samples(0.5, spec.confidence) else None
    p50_ci = _interval(lat, 0.5, rng, spec.n_boot, 0.95) if p50 is not None else None
    bl = spec.percentile
    high = stats.nearest_rank(lat, bl) if len(lat) >= stats.min_samples(bl, spec.confidence) else None
    high_ci = _interval(lat, bl, rng, spec.n_boot, 0.95) if high is not None else None
    return TrendPoint(len(lat), p50, p50_ci, high, high_ci, st.dropped, st.lost, st.over), lat


def _steps(points: list, arrays: list, mwu) -> list[Step | None]:
    """The test of each consecutive pair (None where a side has no p50)."""
    steps: list[Step | None] = [None]
    for i in range(1, len(points)):
        a, b = points[i - 1], points[i]
        if a is None or b is None or a.p50 is None or b.p50 is None:
            steps.append(None)
            continue
        _, p = mwu(arrays[i - 1], arrays[i])
        rel = (b.p50 - a.p50) / a.p50 if a.p50 else (math.inf if b.p50 > a.p50 else 0.0)
        steps.append(Step(i, float(p), rel_change=rel))
    return steps


def _newest_verdict(cell: TrendCell, prev, last, dspec: DiffSpec) -> None:
    """diff's verdict for the newest pair, or a flagged p50 increase at the last step."""
    verdict = (compare_cell(cell.key, prev, last, dspec, cell.device_class) if prev is not None
               else _one_sided(cell.key, last, "new", cell.device_class, dspec))
    cell.newest_verdict, cell.newest_reasons = verdict.verdict, list(verdict.reasons)
    step = cell.steps[-1]
    if step is not None and step.flagged and step.direction == "up":
        cell.newest_reasons.append(f"p50 {fmt_ms(cell.points[-2].p50)} -> {fmt_ms(cell.points[-1].p50)} ms "
                                   f"({step.rel_change:+.0%}), Mann-Whitney p = {step.p_holm:.2g} (Holm)")
        cell.newest_verdict = "regressed"


def run_trend(dirs: list[str], spec: TrendSpec = TrendSpec(), filters: Filters = Filters()) -> TrendResult:
    sweeps, loaded, repeats = _load_sweeps(dirs, spec, filters)
    sides = [side.cells for side in loaded]
    if not any(sum(key in side for side in sides) >= 2 for key in set().union(*sides)):
        raise TrendInputError(f"no cell is in two of the {len(sides)} sweeps (cells match on workload, phase, "
                              "mechanism, delivery and device class): there is no trend to show")
    mwu, mwu_name = _mwu_impl()
    cells: list[TrendCell] = []
    samples: dict[tuple, list] = {}
    tests: list[tuple[TrendCell, Step]] = []
    for key in sorted(set().union(*sides)):
        points, arrays = zip(*(_point(side, key, i, spec) for i, side in enumerate(sides)))
        cell = TrendCell(*key, points=list(points), steps=_steps(points, arrays, mwu))
        cells.append(cell)
        samples[key] = list(arrays)
        tests += [(cell, s) for s in cell.steps if s is not None]
    for (cell, step), adj in zip(tests, holm([s.p_value for _, s in tests])):
        step.p_holm = adj
        step.flagged = adj < spec.alpha and fold_change(step.rel_change) - 1.0 > spec.rel_threshold
    dspec = spec.diff_spec()
    for cell in cells:
        cell.first_flag = next((s.index for s in cell.steps if s is not None and s.flagged), None)
        prev, last = sides[-2].get(cell.key), sides[-1].get(cell.key)
        if last is not None:
            _newest_verdict(cell, prev, last, dspec)
    n_invalid, notes = _attach_invalid(cells, sweeps, loaded)
    order = {True: 0, False: 1}
    cells.sort(key=lambda c: (order[c.regressed], c.first_flag is None, c.key))
    checks = [None] + [noise.compare_noise(a.noise, b.noise, spec.noise, (f"sweep {i}", f"sweep {i + 1}"))
                       for i, (a, b) in enumerate(zip(loaded, loaded[1:]), start=1)]
    return TrendResult(spec, sweeps, cells, len(tests), mwu_name, samples, [*map(str, repeats), *notes], n_invalid,
                       checks)


def _attach_invalid(cells: list[TrendCell], sweeps: list[SweepInfo], loaded: list) -> tuple[int, list[str]]:
    """Each sweep's invalid records named in their cell's reasons (the cell then counts as regressed:
    its figures cannot be trusted), as diff does."""
    def mark(cell: TrendCell, said: str) -> None:
        cell.newest_reasons.append(said)
        cell.newest_verdict = "regressed"

    return attach_invalid(cells, [(f"sweep {s.index + 1} ({s.path})", side.invalid) for s, side in zip(sweeps, loaded)],
                          mark)
