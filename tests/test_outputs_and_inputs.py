"""Issue 27, the command surface: outputs that never clobber, every output checked before any is
written, no false "defects found", typos refused, names equal after folding refused, argparse
messages that read well.

Every test runs the real command (``cancelbench ...`` in a subprocess) on datasets built without
Ray (tests/report_fixtures.py); none of them starts Ray.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from report_fixtures import cell_rows, known_answer_rows, write_dataset  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def cancelbench(*args, env=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cancelbench.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env=env, **kw)


def one_line_exit_2(r, *needles: str, prefix: str = "") -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[0].startswith(prefix), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot(d: Path) -> dict:
    """Every entry under ``d`` (also ``d`` itself when a file): kind and bytes."""
    out = {}
    for p in [d, *d.rglob("*")] if d.is_dir() else [d]:
        st = os.lstat(p)
        out[str(p)] = (stat.S_IFMT(st.st_mode), p.read_bytes() if stat.S_ISREG(st.st_mode) else os.readlink(p)
                       if stat.S_ISLNK(st.st_mode) else None)
    return out


def clean_rows(workload: str = "tts", n: int = 40, latency: float = 5.0, **kw) -> list[dict]:
    """One device, one cell, no defects, under the bound: the report's verdict is exit 0."""
    return cell_rows(f"{workload}-c", [latency] * n, workload=workload, **kw)


@pytest.fixture()
def ds(tmp_path) -> Path:
    return write_dataset(tmp_path / "ds", clean_rows())


@pytest.fixture()
def ds2(tmp_path) -> Path:
    return write_dataset(tmp_path / "ds2", clean_rows())


# ------------------------------------------------------------------------------------ 1. outputs

def _not_regular(tmp_path: Path, kind: str) -> Path:
    p = tmp_path / f"out-{kind}"
    if kind == "fifo":
        os.mkfifo(p)
    elif kind == "symlink":
        target = tmp_path / "precious.txt"
        target.write_text("keep me\n")
        p.symlink_to(target)
    elif kind == "dangling symlink":
        p.symlink_to(tmp_path / "nowhere.txt")
    elif kind == "directory":
        p.mkdir()
        (p / "inside.txt").write_text("keep\n")
    elif kind == "device":
        try:  # a char device node like /dev/zero, made here so a failing test replaces nothing shared
            os.mknod(p, 0o666 | stat.S_IFCHR, os.makedev(1, 5))
        except (PermissionError, OSError):
            pytest.skip("cannot make a device node here")
    return p


@pytest.mark.parametrize("kind", ["fifo", "symlink", "dangling symlink", "directory", "device"])
@pytest.mark.parametrize("option", ["--json", "--html", "--markdown", "--junit"])
def test_report_refuses_an_output_that_is_not_a_regular_file(tmp_path, ds, kind, option):
    out = _not_regular(tmp_path, kind)
    before = snapshot(tmp_path)
    r = cancelbench("report", ds, option, out, timeout=60)  # a FIFO without a reader would hang the old code
    one_line_exit_2(r, option, "not a regular file", prefix="cancelbench report: error:")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("command", ["diff", "trend"])
def test_diff_and_trend_refuse_a_non_regular_output(tmp_path, ds, ds2, command):
    out = _not_regular(tmp_path, "symlink")
    before = snapshot(tmp_path)
    extra = ["--by", "given"] if command == "trend" else []
    r = cancelbench(command, ds, ds2, *extra, "--markdown", out)
    one_line_exit_2(r, "--markdown", "symbolic link", prefix=f"cancelbench {command}: error:")
    assert snapshot(tmp_path) == before


def test_an_output_inside_an_input_dataset_is_refused(tmp_path, ds, ds2):
    """`report D --json D/manifest.json` destroyed the dataset it read; also through a symlink to
    the dataset, a new file inside it, and for diff's and trend's inputs.  (A hard link to the manifest
    outside the dataset is another name: the rename replaces that name, not the manifest.)"""
    link = tmp_path / "link"
    link.symlink_to(ds)
    hard = tmp_path / "manifest-hardlink.json"
    os.link(ds / "manifest.json", hard)
    before = snapshot(ds)
    cases = [
        ("report", [ds, "--json", ds / "manifest.json"]),
        ("report", [ds, "--html", ds / "records" / "new.html"]),
        ("report", [ds, "--markdown", link / "manifest.json"]),
        ("report", [link, "--json", ds / "report.json"]),
        ("diff", [ds2, ds, "--json", ds / "manifest.json"]),
        ("trend", [ds, ds2, "--by", "given", "--html", ds2 / "t.html"]),
    ]
    for command, args in cases:
        r = cancelbench(command, *args)
        one_line_exit_2(r, "input", prefix=f"cancelbench {command}: error:")
    assert snapshot(ds) == before and hard.read_bytes() == (ds / "manifest.json").read_bytes()
    assert cancelbench("report", ds).returncode == 0  # still readable


def test_lock_refuses_to_replace_its_own_input_or_a_non_regular_file(tmp_path):
    model = tmp_path / "small.gguf"
    model.write_bytes(b"GGUF" + bytes(100))
    before = model.read_bytes()
    one_line_exit_2(cancelbench("lock", model, "--out", model), "is the input", prefix="cancelbench: error:")
    one_line_exit_2(cancelbench("lock", model, "--out", tmp_path / "." / "small.gguf"), "is the input")
    fifo = _not_regular(tmp_path, "fifo")
    one_line_exit_2(cancelbench("lock", model, "--out", fifo, timeout=60), "FIFO")
    one_line_exit_2(cancelbench("lock", model, "--out", ""), "--out", "empty")
    assert model.read_bytes() == before and stat.S_ISFIFO(os.lstat(fifo).st_mode)
    ok = cancelbench("lock", model, "--out", tmp_path / "lock.json")
    assert ok.returncode == 0, ok.stderr


# ------------------------------------------------------------------------------------ 2. sweep --out

def test_sweep_out_inside_another_dataset_is_refused(tmp_path, ds):
    before = snapshot(ds)
    for out in (ds / "records", ds / "nested" / "deeper", ds / "records" / "backend=cpu"):
        one_line_exit_2(cancelbench("sweep", "--out", out), "inside the dataset", prefix="cancelbench: error:")
    assert snapshot(ds) == before


def test_sweep_out_into_a_foreign_or_symlinked_directory_is_refused(tmp_path):
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "holiday.jpg").write_bytes(b"\xff\xd8")
    one_line_exit_2(cancelbench("sweep", "--out", foreign), "not a cancelbench dataset", "holiday.jpg")
    # report.html / report.txt from outside a sweep: never silently overwritten
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / "report.html").write_text("<p>someone's page</p>")
    one_line_exit_2(cancelbench("sweep", "--out", stale), "not a cancelbench dataset", "report.html")
    target = tmp_path / "real"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    one_line_exit_2(cancelbench("sweep", "--out", link), "symbolic link")
    one_line_exit_2(cancelbench("sweep", "--out", ""), "--out", "empty", prefix="cancelbench sweep: error:")
    assert sorted(p.name for p in foreign.iterdir()) == ["holiday.jpg"]
    assert (stale / "report.html").read_text() == "<p>someone's page</p>" and list(target.iterdir()) == []


def test_sweep_report_file_that_is_not_regular_is_refused_even_in_a_dataset(tmp_path, ds):
    (ds / "report.html").mkdir()
    one_line_exit_2(cancelbench("sweep", "--out", ds, "--resume"), "report.html", "directory")


# ------------------------------------------------------------------------------------ 3. all or nothing

@pytest.mark.parametrize("command", ["report", "diff", "trend"])
def test_one_bad_output_means_nothing_is_written(tmp_path, ds, ds2, command):
    good = tmp_path / "good.html"
    args = {"report": [ds], "diff": [ds, ds2], "trend": [ds, ds2, "--by", "given"]}[command]
    r = cancelbench(command, *args, "--html", good, "--json", tmp_path / "nonexistent" / "x.json")
    one_line_exit_2(r, "--json", "does not exist", prefix=f"cancelbench {command}: error:")
    assert not good.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ds", "ds2"]
    same = cancelbench(command, *args, "--json", tmp_path / "x.json", "--markdown", tmp_path / "x.json")
    one_line_exit_2(same, "same file")
    assert not (tmp_path / "x.json").exists()


# ------------------------------------------------------------------------------------ 5. false defects

@pytest.mark.parametrize("command", ["diff", "trend"])
@pytest.mark.parametrize("n", ["99999999999", "100001", "99", "-5"])
def test_bootstrap_is_bounded(ds, ds2, command, n):
    extra = ["--by", "given"] if command == "trend" else []
    r = cancelbench(command, ds, ds2, *extra, "--bootstrap", n, timeout=120)
    one_line_exit_2(r, "--bootstrap", "100..100,000", prefix=f"cancelbench {command}: error:")


def test_a_closed_stdout_is_no_traceback(ds):
    """`cancelbench report D >&-`: exit status per the verdict (0 here), nothing on stderr."""
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "report", str(ds)], stderr=subprocess.PIPE,
                       text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert r.returncode == 0 and r.stderr == "", r.stderr
    bad = write_dataset(ds.parent / "defects", known_answer_rows())  # a dropped cancel: verdict exit 1
    r = subprocess.run([sys.executable, "-m", "cancelbench.cli", "report", str(bad)], stderr=subprocess.PIPE,
                       text=True, timeout=120, preexec_fn=lambda: os.close(1))
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["report", "diff"])
def test_a_reader_that_stops_early_is_no_traceback(ds, ds2, command):
    """`cancelbench report D --format html | head -1`: the page is larger than a pipe holds."""
    args = [ds] if command == "report" else [ds, ds2]
    proc = subprocess.Popen([sys.executable, "-m", "cancelbench.cli", command, *map(str, args), "--format", "html"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = proc.stdout.readline()
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0 and first and "Traceback" not in err and err == "", err


def test_step_summary_naming_a_fifo_without_reader_never_hangs(tmp_path, ds):
    fifo = tmp_path / "summary"
    os.mkfifo(fifo)
    env = {**os.environ, "GITHUB_STEP_SUMMARY": str(fifo)}
    start = time.monotonic()
    r = cancelbench("report", ds, env=env, timeout=60)
    assert r.returncode == 0 and time.monotonic() - start < 60
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "warning" in lines[0] and "GITHUB_STEP_SUMMARY" in lines[0], r.stderr
    (tmp_path / "dir").mkdir()
    r = cancelbench("report", ds, env={**os.environ, "GITHUB_STEP_SUMMARY": str(tmp_path / "dir")})
    assert r.returncode == 0 and "GITHUB_STEP_SUMMARY" in r.stderr and "Traceback" not in r.stderr


# ------------------------------------------------------------------------------------ 6. silently ignored

@pytest.mark.parametrize("bound_for, needle", [("nosuch=5", "no workload 'nosuch'"),
                                               ("tts:nophase=5", "no phase 'nophase'"),
                                               ("*:nophase=5", "no phase 'nophase'"),
                                               ("tts:decode=nan", "finite")])
@pytest.mark.parametrize("command", ["report", "diff", "trend"])
def test_bound_for_typos_are_refused(ds, ds2, command, bound_for, needle):
    args = {"report": [ds], "diff": [ds, ds2], "trend": [ds, ds2, "--by", "given"]}[command]
    r = cancelbench(command, *args, "--bound-for", bound_for)
    one_line_exit_2(r, needle, prefix=f"cancelbench {command}: error:")
    ok = cancelbench(command, *args, "--bound-for", "tts:decode=5", "--bound-for", "tts=7",
                     "--bound-for", "*:decode=9")
    assert ok.returncode in (0, 1) and "error" not in ok.stderr, ok.stderr


def test_names_with_colon_equals_and_star_are_addressable(tmp_path):
    """The last `=` splits off the bound; `\\:` and `\\*` are a literal colon and star."""
    d = write_dataset(tmp_path / "odd", clean_rows(workload="a:b=c*", latency=20.0)
                      + clean_rows(workload="*", latency=20.0, phase="x:y"))
    r = cancelbench("report", d, "--format", "json", "--bound-for", r"a\:b=c\*=10", "--bound-for", r"\*:x\:y=11")
    assert r.returncode == 0, r.stderr
    cells = {(c["workload"], c["phase"]): c for c in json.loads(r.stdout)["cells"]}
    assert cells[("a:b=c*", "decode")]["bound_ms"] == 10.0 and cells[("*", "x:y")]["bound_ms"] == 11.0
    assert cells[("a:b=c*", "decode")]["over"] and cells[("*", "x:y")]["over"]
    r = cancelbench("report", d, "--bound-for", "a:b=c*=10")  # unescaped: workload "a", phase "b=c*"
    one_line_exit_2(r, "no workload 'a'")


def test_empty_paths_and_misplaced_ray_options_are_refused(tmp_path, ds):
    one_line_exit_2(cancelbench("report", ds, "--markdown", ""), "--markdown", "empty")
    one_line_exit_2(cancelbench("report", ds, "--json", " "), "--json", "empty")
    one_line_exit_2(cancelbench("report", ds, "--engine", "ray", "--ray-address", ""), "--ray-address", "empty")
    one_line_exit_2(cancelbench("diff", ds, ds, "--workload", ""), "--workload", "empty")
    one_line_exit_2(cancelbench("sweep", "--address", "", "--out", tmp_path / "s"), "--address", "empty")
    before = sorted(os.listdir(tmp_path))
    one_line_exit_2(cancelbench("fixtures", "--out", "", "--which", "text"), "--out", "empty",
                    prefix="cancelbench fixtures: error:")
    assert sorted(os.listdir(tmp_path)) == before
    one_line_exit_2(cancelbench("report", ds, "--ray-address", "127.0.0.1:6379"), "--engine ray")
    start = time.monotonic()
    r = cancelbench("report", ds, "--engine", "ray", "--ray-address", "ray://10.0.0.1:10001", timeout=60)
    one_line_exit_2(r, "ray://", prefix="cancelbench report: error:")
    assert time.monotonic() - start < 20  # refused at once, not after Ray Client's 30 s timeout
    env = {**os.environ, "RAY_ADDRESS": "ray://10.0.0.1:10001"}
    one_line_exit_2(cancelbench("report", ds, "--engine", "ray", env=env, timeout=60), "ray://")


def test_empty_host_names_in_a_sweep_config_are_refused(tmp_path):
    config = tmp_path / "sweep.toml"
    for hosts in ('["", ""]', '["  "]', '["a", "a"]'):
        config.write_text(f"[devices]\nhosts = {hosts}\n")
        one_line_exit_2(cancelbench("sweep", "--config", config, "--out", tmp_path / "out"), "devices.hosts")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ 7. folded names

def _sim_config(names: list[str]) -> str:
    return "".join(f'[[workload]]\nname = {json.dumps(n)}\nengine = "sim"\n' for n in names)


@pytest.mark.parametrize("a, b", [("Simw", "simw"), ("ｓｉｍｗ", "simw"), ("simw ", "simw"), ("STRASSE", "straße"),
                                  ("ﬁle", "file")])
def test_workload_names_equal_after_folding_are_duplicates(tmp_path, a, b):
    config = tmp_path / "sweep.toml"
    config.write_text(_sim_config([a, b]))
    one_line_exit_2(cancelbench("sweep", "--config", config, "--out", tmp_path / "out"), "differ only by",
                    prefix="cancelbench: error:")
    assert not (tmp_path / "out").exists()


def test_workload_name_folding_property():
    """Any two names that are equal after NFKC + case folding (+ surrounding whitespace) are
    refused as duplicates; distinct folded names are accepted."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from cancelbench.orchestrator.config import ConfigError, parse_config

    def folded(name: str) -> str:
        return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold()).strip()

    def config(names):
        return {"workload": [{"name": n, "engine": "sim"} for n in names]}

    name = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=8)
    variant = st.sampled_from([str.upper, str.lower, str.title, lambda s: s + " ", lambda s: " " + s,
                               lambda s: unicodedata.normalize("NFKD", s),
                               lambda s: "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in s)])

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(name, variant)
    def equal_after_folding(base, change):
        other = change(base)
        if not folded(base) or folded(other) != folded(base):
            hypothesis.assume(False)
        with pytest.raises(ConfigError):
            parse_config(config([base, other]))

    @settings(max_examples=200, deadline=None, derandomize=True)
    @given(st.lists(name, min_size=2, max_size=4))
    def distinct_folded(names):
        hypothesis.assume(all(folded(n) for n in names) and len({folded(n) for n in names}) == len(names))
        try:
            parse_config(config(names))
        except ConfigError as exc:
            assert "differ only by" not in str(exc) and "unique" not in str(exc), exc

    equal_after_folding()
    distinct_folded()


def test_lock_refuses_two_files_with_the_same_name(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "m.gguf").write_bytes(sub.encode() * 10)
    r = cancelbench("lock", tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", "--out", tmp_path / "l.json")
    one_line_exit_2(r, "two files named m.gguf")
    assert not (tmp_path / "l.json").exists()


# ------------------------------------------------------------------------------------ 8. smaller

def _typed_options(command: str):
    """(option, first choice or None) of every option of ``command`` that converts its value."""
    from cancelbench.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return sub, [a for a in sub._actions if a.option_strings and (a.type not in (None, str, Path) or a.choices)]


@pytest.mark.parametrize("command", ["report", "diff", "trend", "sweep", "fixtures"])
def test_argparse_errors_name_the_sub_command_and_read_well(ds, command):
    sub, actions = _typed_options(command)
    assert actions, command
    positional = {"report": [ds], "diff": [ds, ds], "trend": [ds, ds]}.get(command, [])
    for action in actions:
        r = cancelbench(command, *positional, action.option_strings[-1], "x!")
        line = one_line_exit_2(r, action.option_strings[-1], prefix=f"cancelbench {command}: error:")
        assert "invalid _" not in line and "_percent" not in line and "_fraction" not in line, line
    r = cancelbench(command, *positional, "--no-such-option")
    one_line_exit_2(r, "unrecognized arguments", prefix=f"cancelbench {command}: error:")


def test_every_option_help_lists_is_in_the_synopsis():
    """docs/cli.md's synopsis names every sub-command, every option `--help` lists and every
    --format choice."""
    from cancelbench.cli import build_parser

    text = (REPO / "docs" / "cli.md").read_text()
    synopsis = text[text.index("```\n") + 4:text.index("```", text.index("```\n") + 4)]
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for name, sub in subs.items():
        line_start = f"cancelbench {name}"
        assert line_start in synopsis, name
        block = synopsis[synopsis.index(line_start):]
        nxt = block.find("\ncancelbench ", 1)
        block = block if nxt < 0 else block[:nxt]
        for action in sub._actions:
            for opt in action.option_strings:
                if opt.startswith("--") and opt != "--help":
                    assert opt in block, f"{name} {opt} missing from docs/cli.md's synopsis"
            if action.dest == "format":
                for choice in action.choices:
                    assert choice in block, f"{name} --format {choice} missing from the synopsis"


def test_trend_glob_skips_a_stray_file_with_a_warning(tmp_path):
    for i in range(2):
        write_dataset(tmp_path / f"sweep-{i}", clean_rows())
    (tmp_path / "sweep-notes.txt").write_text("not a dataset")
    r = cancelbench("trend", tmp_path / "sweep-*", "--by", "given", "--format", "json")
    assert r.returncode == 0, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("cancelbench trend: warning:") and "sweep-notes.txt" in lines[0]
    assert len(json.loads(r.stdout)["sweeps"]) == 2


def test_trend_without_a_shared_cell_says_so(tmp_path):
    a = write_dataset(tmp_path / "a", clean_rows(workload="tts"))
    b = write_dataset(tmp_path / "b", clean_rows(workload="stt"))
    r = cancelbench("trend", a, b, "--by", "given")
    one_line_exit_2(r, "no cell is in two of the 2 sweeps", prefix="cancelbench trend: error:")
    assert "OK" not in r.stdout


def test_trend_note_has_no_doubled_parentheses(ds, ds2):
    r = cancelbench("trend", ds, ds2, "--by", "given")
    assert r.returncode == 0, r.stderr
    assert "((" not in r.stdout and "))" not in r.stdout and "Mann-Whitney U" in r.stdout, r.stdout


def test_diff_at_the_median_prints_its_header_once(ds, ds2):
    r = cancelbench("diff", ds, ds2, "--percentile", "50")
    assert r.returncode == 0, r.stderr
    header = next(line for line in r.stdout.splitlines() if line.startswith("verdict "))
    # the latency columns once each ("p50 ms", "p50 change"), not a second "p50 ms" for the median;
    # the residue split's "work p50 ms" is another column
    assert header.replace("work p50 ms", "").split().count("p50") == 2, header
    r = cancelbench("diff", ds, ds2)
    header = next(line for line in r.stdout.splitlines() if line.startswith("verdict "))
    assert "p50 ms" in header and "p99 ms" in header, header


def test_report_on_ray_prints_no_ray_log_lines(ds):
    """`report --engine ray` on success: the report on stdout, nothing on stderr (Ray's INFO lines,
    about 20 of them, used to follow).  Starts a local Ray: marked ``cluster`` in conftest."""
    r = cancelbench("report", ds, "--engine", "ray", timeout=600)
    assert r.returncode == 0 and r.stderr == "", r.stderr[-3000:]
    assert r.stdout == cancelbench("report", ds).stdout


def test_the_raylets_worker_count_warning_never_reaches_the_report(capsys):
    """Ray prints the raylet's messages to stdout whatever log_to_driver says (CI: its "8 PYTHON
    worker processes have been started" landed inside `report --engine ray`'s output). Through
    Ray's own printer: that warning is dropped, any other raylet message goes to stderr."""
    from ray._private import worker

    from cancelbench.reports.raydata import _quiet_worker_count_warning

    before = worker.print_to_stdstream
    try:
        _quiet_worker_count_warning()
        _quiet_worker_count_warning()  # idempotent: not wrapped twice
        assert worker.print_to_stdstream.cancelbench_quiet and worker.print_to_stdstream is not before
        for line in ("WARNING: 12 PYTHON worker processes have been started on node: n with address: 127.0.0.1",
                     "A worker died or was killed"):
            worker.print_to_stdstream({"lines": [line], "pid": "raylet", "is_err": False}, ignore_prefix=False)
        out, err = capsys.readouterr()
        assert out == "" and err == "(raylet) A worker died or was killed\n"
    finally:
        worker.print_to_stdstream = before
