"""The native interface: importing cancelbench.native loads nothing until first use."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cancelbench import native


def _python(script: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("CANCELBENCH_NATIVE_LIB", "CANCELBENCH_TEST_CLOCK_SKEW_NS")}
    cp = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env={**base, **env},
                        capture_output=True, text=True, timeout=300)
    assert cp.returncode == 0, cp.stderr[-3000:]
    return cp


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_import_loads_nothing_until_first_use(tmp_path):
    """Importing cancelbench.native neither compiles nor maps the library; the first call does."""
    cache = tmp_path / "cache"
    _python(f"""
        import os
        import cancelbench.native as native

        def mapped():
            return native.LIB_BASENAME in open("/proc/self/maps").read()

        assert not native.loaded() and not mapped(), "import loaded the native library"
        assert not os.path.exists({str(cache)!r}), "import compiled the native library"
        native.now_ns()
        assert native.loaded() and mapped()
        """, XDG_CACHE_HOME=str(cache))


def test_import_succeeds_without_a_library_and_first_use_reports_it(tmp_path):
    missing = tmp_path / "nowhere" / "_cancelbench_native.so"
    _python(f"""
        import cancelbench.native as native
        try:
            native.CancelToken()
        except OSError as exc:
            assert {str(missing)!r} in str(exc), exc
        else:
            raise AssertionError("loaded a library that does not exist")
        assert not native.loaded()
        """, CANCELBENCH_NATIVE_LIB=str(missing))


def test_clock_skew_variable_is_applied_at_first_load():
    """The variable is read when the library is first loaded (set here after the import),
    and shifts the agent clock by exactly the skew relative to CLOCK_MONOTONIC."""
    skew = 10**15  # ~11.6 days: no tolerance below can mistake it for scheduling noise
    _python(f"""
        import os, time
        import cancelbench.native as native
        os.environ["CANCELBENCH_TEST_CLOCK_SKEW_NS"] = "{skew}"
        before = time.monotonic_ns()
        agent = native.now_ns()
        after = time.monotonic_ns()
        assert before + {skew} <= agent <= after + {skew}, (before, agent, after)
        """)
