"""libcancelbench, the cancel token as a C library (native/build_libcancelbench.sh, issue 35):
a C program (tests/data/c/libcancelbench_demo.c) that includes only the installed header and
links the installed library through ``pkg-config --cflags --libs cancelbench``, plus the
wheel's libllama and libmtmd, stops a real ``llama_decode`` of the text fixture through the
byte reader on ``llama_set_abort_callback`` (rc 2) and the ASR fixture's clip audio encode
through the eval reader as ``mtmd_context_params.cb_eval``; a second build links the static
library. Nothing here is a timing assertion: the program's setter thread waits on the
reader's poll count, and the asserts read stamps and counters.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PREFIX = ROOT / "build" / "libcancelbench"
PC_DIR = PREFIX / "lib" / "pkgconfig"
DEMO = ROOT / "tests" / "data" / "c" / "libcancelbench_demo.c"
HEADER = ROOT / "native" / "cancel_token.h"
MODELS = ROOT / "datasets" / "models"
TEXT_MODEL = MODELS / "text-qwen3-14m.gguf"
ASR_TEXT, ASR_MMPROJ = MODELS / "qwen3asr-fixture-text.gguf", MODELS / "qwen3asr-fixture-mmproj.gguf"
HANG_GUARD_S = 300  # only against a hung build or program


def _run(cmd, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=HANG_GUARD_S, **kw)


def _pkg_config(*args: str) -> list[str]:
    cp = _run(["pkg-config", *args, "cancelbench"], env={**os.environ, "PKG_CONFIG_PATH": str(PC_DIR)})
    assert cp.returncode == 0, cp.stderr
    return cp.stdout.split()


@pytest.fixture(scope="module")
def installed() -> Path:
    for tool in ("cc", "pkg-config"):
        if not shutil.which(tool):
            pytest.skip(f"no {tool} here")
    cp = _run(["bash", "native/build_libcancelbench.sh"])
    assert cp.returncode == 0, cp.stderr[-2000:]
    return PREFIX


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict:
    """The wheel's libllama directory and the include dirs of llama.h/ggml (build_sut_engine.sh
    extracts them from the sdist) and of mtmd.h (from the same sdist, here)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llama_cpp is not installed")
    lib = Path(list(spec.submodule_search_locations)[0]) / "lib"
    version = importlib.metadata.version("llama_cpp_python")
    inc = ROOT / "build" / "sut" / "include" / version
    if not (inc / "llama.h").exists():
        cp = _run(["bash", "native/build_sut_engine.sh"])
        if cp.returncode != 0 or not (inc / "llama.h").exists():
            pytest.skip(f"no llama.h for {version} (native/build_sut_engine.sh: {cp.stderr[-400:]})")
    mtmd_inc = tmp_path_factory.mktemp("mtmd-include")
    sdist = ROOT / "build" / "sdist" / f"llama_cpp_python-{version}.tar.gz"
    have_mtmd = False
    if sdist.exists() and (lib / "libmtmd.so").exists():
        with tarfile.open(sdist) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("vendor/llama.cpp/tools/mtmd/mtmd.h")), None)
            if member is not None:
                (mtmd_inc / "mtmd.h").write_bytes(tar.extractfile(member).read())
                have_mtmd = True
    return {"lib": lib, "inc": inc, "mtmd_inc": mtmd_inc, "have_mtmd": have_mtmd}


def _build(out: Path, llama: dict, *, static: bool, mtmd: bool) -> Path:
    cflags = _pkg_config("--cflags")
    if static:  # the archive itself: -lcancelbench would pick the .so
        libs = [str(PREFIX / "lib" / "libcancelbench.a")]
    else:
        libs = _pkg_config("--libs") + [f"-Wl,-rpath,{PREFIX / 'lib'}"]
    lib = llama["lib"]
    cmd = ["cc", "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread", *cflags,
           f"-I{llama['inc']}", f'-DDEMO_LLAMA_LIB_DIR="{lib}"']
    if mtmd:
        cmd += [f"-I{llama['mtmd_inc']}", "-DDEMO_WITH_MTMD"]
    cmd += [str(DEMO), "-o", str(out), *libs, f"-L{lib}", f"-Wl,-rpath,{lib}"]
    cmd += (["-lmtmd"] if mtmd else []) + ["-lllama", "-lggml", "-lggml-base", "-lm"]
    cp = _run(cmd)
    assert cp.returncode == 0, f"{' '.join(cmd)}\n{cp.stderr[-3000:]}"
    return out


def _facts(cp: subprocess.CompletedProcess) -> dict[str, str]:
    assert cp.returncode == 0, (cp.stdout[-2000:], cp.stderr[-2000:])
    facts = dict(line.split("=", 1) for line in cp.stdout.splitlines() if "=" in line)
    assert facts.get("done") == "1", cp.stdout[-2000:]
    return facts


def _needed(binary: Path) -> list[str]:
    cp = _run(["readelf", "-d", str(binary)])
    assert cp.returncode == 0, cp.stderr
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", cp.stdout)


def _models(*paths: Path) -> None:
    missing = [p.name for p in paths if not p.exists()]
    if missing:
        pytest.skip(f"fixture models missing ({missing}): .venv/bin/cancelbench fixtures")


def test_the_install_prefix_is_versioned_and_relocatable(installed):
    """One header, a SONAME carrying the header's ABI major, a .a, a .pc whose prefix is its own
    directory's, and exactly the header's CB_EXPORT functions exported."""
    text = HEADER.read_text()
    major = re.search(r"^#define CANCELBENCH_ABI_VERSION_MAJOR (\d+)$", text, re.M).group(1)
    minor = re.search(r"^#define CANCELBENCH_ABI_VERSION_MINOR (\d+)$", text, re.M).group(1)
    assert (installed / "include" / "cancelbench" / "cancel_token.h").read_text() == text
    lib = installed / "lib"
    assert (lib / "libcancelbench.a").is_file()
    assert os.readlink(lib / "libcancelbench.so") == f"libcancelbench.so.{major}"
    assert os.readlink(lib / f"libcancelbench.so.{major}") == f"libcancelbench.so.{major}.{minor}.0"
    dyn = _run(["readelf", "-d", str(lib / f"libcancelbench.so.{major}.{minor}.0")]).stdout
    assert f"Library soname: [libcancelbench.so.{major}]" in dyn
    pc = (PC_DIR / "cancelbench.pc").read_text()
    assert "prefix=${pcfiledir}/../.." in pc and f"Version: {major}.{minor}.0" in pc
    assert str(ROOT) not in pc  # relocatable: no absolute path baked in
    assert _pkg_config("--modversion") == [f"{major}.{minor}.0"]
    exported = _run(["nm", "-D", "--defined-only", str(lib / "libcancelbench.so")]).stdout
    symbols = {line.split()[2] for line in exported.splitlines() if len(line.split()) == 3 and line.split()[1] == "T"}
    declared = set(re.findall(r"^CB_EXPORT [^(]*?[ *](cb_\w+)\(", text, re.M))
    assert "cb_abi_version" in declared and symbols == declared


def test_the_demo_stops_llama_decode_and_an_mtmd_clip_graph(installed, llama, tmp_path):
    _models(TEXT_MODEL, ASR_TEXT, ASR_MMPROJ)
    if not llama["have_mtmd"]:
        pytest.skip("no mtmd.h in the llama-cpp-python sdist or no libmtmd.so in the wheel")
    demo = _build(tmp_path / "demo", llama, static=False, mtmd=True)
    assert any(n.startswith("libcancelbench.so.") for n in _needed(demo)), _needed(demo)
    f = _facts(_run([str(demo), str(TEXT_MODEL), str(ASR_TEXT), str(ASR_MMPROJ)]))
    major = int(f["abi.header"]) // 1000
    assert int(f["abi.runtime"]) // 1000 == major and int(f["abi.runtime"]) >= int(f["abi.header"])
    # the token: set, read (the flag byte too), reset clears the trial state, keeps the slice
    for key in ("token.set_ns_positive", "token.second_set_keeps_first", "token.is_set", "token.flag_byte",
                "token.reader_after_set", "token.seen_after_set", "token.reset_clears", "token.reset_keeps_slice"):
        assert f[key] == "1", key
    assert f["token.before_set"] == "0" and f["token.reader_before_set"] == "0" and f["token.polls"] == "2"
    # llama_decode stopped by the byte reader: rc 2, the reader saw the set token
    assert f["llama.rc"] == "2"
    assert f["llama.seen_after_set"] == "1" and int(f["llama.polls"]) >= 1
    assert f["llama.seen_where"] == "0"  # the abort reader, not the eval reader, stamped it
    if f["llama.mode"] == "thread":  # set from the second thread while the graph ran
        assert 1 <= int(f["llama.polls_at_set"]) <= int(f["llama.polls"])
    assert f["llama.after_abort_rc"] == "0"  # the context stays usable
    # the clip audio encode stopped by the eval reader: fewer nodes asked than the whole graph
    assert f["mtmd.audio"] == "1" and f["mtmd.full_rc"] == "0" and f["mtmd.full_seen_ns"] == "0"
    assert int(f["mtmd.polls"]) < int(f["mtmd.full_polls"]), f
    assert f["mtmd.seen_after_set"] == "1"
    assert f["mtmd.seen_where"] in ("1", "2") and int(f["mtmd.seen_cpu_ns"]) > 0
    assert int(f["mtmd.syncs"]) >= 1
    if f["mtmd.mode"] == "thread":
        assert int(f["mtmd.polls_at_set"]) >= 1


def test_the_static_library_links(installed, llama, tmp_path):
    """The demo against libcancelbench.a (no libcancelbench.so needed), run once on the text model."""
    _models(TEXT_MODEL)
    demo = _build(tmp_path / "demo-static", llama, static=True, mtmd=False)
    assert not any(n.startswith("libcancelbench") for n in _needed(demo)), _needed(demo)
    f = _facts(_run([str(demo), str(TEXT_MODEL)]))
    assert f["token.reset_clears"] == "1" and f["llama.rc"] == "2" and f["llama.seen_after_set"] == "1"
    assert "mtmd.rc" not in f
