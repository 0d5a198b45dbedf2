"""The native interface: cancel_token.h against its definitions and its ctypes mirror,
import without side effects, and the token's learned-cost lifecycle.

The header is parsed with a small regex parser rather than pycparser: the header
is ours and written one ``CB_EXPORT <type> <name>(<params>);`` per declaration,
while pycparser would need a preprocessor and fake libc headers for
<stdint.h>/<stdbool.h> (and a new test dependency). The parser refuses a
``CB_EXPORT`` it cannot read, so a declaration written another way fails here
instead of slipping past the check.
"""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cancelbench import native

NATIVE_DIR = Path(native.__file__).resolve().parent
HEADER = NATIVE_DIR / "cancel_token.h"
SOURCE = NATIVE_DIR / "cancel_token.c"

_DECL = re.compile(r"CB_EXPORT\s+(?P<ret>[\w\s]+?\**)\s*(?P<name>cb_\w+)\s*\((?P<params>[^)]*)\)\s*;")
_DEF = re.compile(r"^CB_EXPORT\s+[\w\s]+?\**\s*(?P<name>cb_\w+)\s*\(", re.M)

# C spellings in cancel_token.h -> the ctypes type the bindings must use.
_SCALARS = {"void": None, "bool": ctypes.c_bool, "int": ctypes.c_int, "int64_t": ctypes.c_int64,
            "uint64_t": ctypes.c_uint64, "double": ctypes.c_double}
_POINTERS = {"void": ctypes.c_void_p, "cb_token": ctypes.c_void_p, "int64_t": ctypes.POINTER(ctypes.c_int64)}


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", " ", text, flags=re.S))


def _ctype(spelling: str):
    """'const cb_token *' -> c_void_p; 'int64_t' -> c_int64; an unknown spelling fails."""
    words = spelling.replace("*", " * ").split()
    words = [w for w in words if w != "const"]
    stars = words.count("*")
    base = " ".join(w for w in words if w != "*")
    table = {0: _SCALARS, 1: _POINTERS}.get(stars, {})
    assert base in table, f"no ctypes mapping for C type {spelling!r}: extend the test's tables"
    return table[base]


def _param_type(param: str) -> str:
    """'const cb_token *t' -> 'const cb_token *' (every parameter is named in the header)."""
    m = re.fullmatch(r"(.*?)(\w+)", param.strip(), re.S)
    assert m and m.group(1).strip(), f"unnamed or unreadable parameter {param!r}"
    return m.group(1)


def parse_header(text: str) -> dict[str, tuple]:
    """{name: (restype, argtypes)} of every CB_EXPORT declaration, as ctypes types."""
    body = "\n".join(line for line in _strip_comments(text).splitlines() if not line.lstrip().startswith("#"))
    decls = list(_DECL.finditer(body))
    assert len(decls) == body.count("CB_EXPORT"), "a CB_EXPORT declaration the test's parser cannot read"
    out = {}
    for d in decls:
        params = d["params"].strip()
        args = () if params == "void" else tuple(_ctype(_param_type(p)) for p in params.split(","))
        assert d["name"] not in out, f"{d['name']} declared twice"
        out[d["name"]] = (_ctype(d["ret"]), args)
    return out


@pytest.fixture(scope="module")
def header() -> dict[str, tuple]:
    return parse_header(HEADER.read_text())


def test_the_parser_reads_the_c_spellings_it_meets():
    parsed = parse_header("CB_EXPORT const cb_token *cb_a(void);\n#define CB_EXPORT x\n"
                          "/* CB_EXPORT int cb_comment(void); */\n"
                          "CB_EXPORT int cb_b(const void *x, int64_t n,\n  int64_t *out);")
    assert parsed == {"cb_a": (ctypes.c_void_p, ()),
                      "cb_b": (ctypes.c_int, (ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)))}
    with pytest.raises(AssertionError, match="cannot read"):
        parse_header("CB_EXPORT int (*cb_fn(void))(void);")


def test_the_header_declares_every_exported_definition(header):
    """A CB_EXPORT function defined in cancel_token.c but not declared in the header is
    exported without a contract (the compiler checks the types of those declared)."""
    defined = set(_DEF.findall(_strip_comments(SOURCE.read_text())))
    assert '#include "cancel_token.h"' in SOURCE.read_text()
    assert defined == set(header), {"not declared": defined - set(header), "not defined": set(header) - defined}


def test_ctypes_signatures_match_the_header(header):
    """native.SIGNATURES (what _load applies) declares exactly the header's functions, with
    the ctypes types of their C types: a wrong width or signedness (polls as int64), a
    missing argument, or a function only one side knows fails here."""
    table = {name: (restype, tuple(argtypes)) for name, restype, argtypes in native.SIGNATURES}
    assert len(table) == len(native.SIGNATURES), "a function listed twice in native.SIGNATURES"
    assert set(table) == set(header), {"header only": set(header) - set(table), "ctypes only": set(table) - set(header)}
    for name, (restype, argtypes) in header.items():
        assert table[name] == (restype, argtypes), f"{name}: ctypes {table[name]} != header {(restype, argtypes)}"


def test_the_loaded_library_has_every_declaration_applied(header):
    """_load applies the table to the real library: each header function exists in it
    (a stale prebuilt library fails here) and carries the header's types."""
    lib = native._lib()
    for name, (restype, argtypes) in header.items():
        fn = getattr(lib, name)
        assert fn.restype == restype, name
        assert tuple(fn.argtypes) == argtypes, name


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


# -- learned costs: reset keeps them, forget_costs clears them (known answers) ---------

def _ask(t: native.CancelToken, tensor=None) -> bool:
    return native._lib().cb_token_eval_reader(tensor, True, t.address)


def _seen(t: native.CancelToken) -> bool:
    return native._lib().cb_token_eval_reader(None, False, t.address)


def test_reset_keeps_learned_costs_and_forget_costs_returns_them_to_the_initial_state():
    t = native.CancelToken()
    t.set_slice_us(10_000_000)  # a huge slice: once a cost is learned no range fills it
    assert t.ns_per_work == 0.0  # initial: nothing learned
    assert _ask(t) is True and _seen(t) is True  # nothing learned: one node is the whole range
    learned = t.ns_per_work
    assert learned > 0
    assert _ask(t) is False  # learned: the range stays open

    t.reset()  # between trials: trial state goes, what was learned about the model stays
    assert (t.polls, t.syncs, t.max_range_ns) == (0, 0, 0)
    assert t.ns_per_work == learned and t.slice_us == 10_000_000
    assert _ask(t) is False

    t.set()
    polls, syncs, set_ns = t.polls, t.syncs, t.set_ns
    t.forget_costs()  # a new model: learn again; the slice and the trial state stay
    assert t.ns_per_work == 0.0 and t.slice_us == 10_000_000
    assert t.is_set() and (t.polls, t.syncs, t.set_ns) == (polls, syncs, set_ns)
    t.reset()
    assert _ask(t) is True and _seen(t) is True  # learning again from the first node
    assert t.ns_per_work > 0
    t.close()


# Fake tensors laid out as cb_eval_calibrate expects (ne at 16, op at 80, flags at 84, src at
# 88), with the reader calibrated on them: the prelude of the subprocess scripts below.
FAKE_TENSORS = """
        import ctypes, struct
        import cancelbench.native as native

        NE, OP, FLAGS, SRC = 16, 80, 84, 88
        keep = []

        def tensor(ne, op, flags, src=()):
            buf = ctypes.create_string_buffer(256)
            struct.pack_into("4q", buf, NE, *ne)
            struct.pack_into("ii", buf, OP, op, flags)
            for i, s in enumerate(src):
                struct.pack_into("Q", buf, SRC + 8 * i, ctypes.addressof(s))
            keep.append(buf)
            return buf

        k, m, n = 48, 80, 7
        a = tensor((k, m, 1, 1), 0, 1)
        b = tensor((k, n, 1, 1), 0, 0)
        mm = tensor((m, n, 1, 1), 26, 2, (a, b))
        assert native.calibrate_eval_reader(ctypes.addressof(a), ctypes.addressof(b), ctypes.addressof(mm), k, m, n)
        COMPUTE = 16
"""


def test_forget_costs_clears_the_per_op_scales():
    """Per-op scales, with fake tensors laid out as cb_eval_calibrate expects (ne at 16, op at
    80, flags at 84, src at 88). After op A set the cost, the first node of op B ends its
    range to learn B's scale; once learned it does not. After forget_costs B is unknown
    again. Run in a subprocess: calibration is process-wide and must not leak into the
    layout learned from the real ggml by other tests."""
    _python(FAKE_TENSORS + """
        node_a = ctypes.addressof(tensor((1000, 1, 1, 1), 5, COMPUTE))
        node_b = ctypes.addressof(tensor((1000, 1, 1, 1), 6, COMPUTE))
        assert native.node_work(node_a) == 1000 + 1024  # the fake layout is read as intended

        ev = native._lib().cb_token_eval_reader
        t = native.CancelToken()
        t.set_slice_us(10_000_000)

        def learn_a_then_ask_b():
            assert ev(node_a, True, t.address) is True and ev(None, False, t.address) is True
            assert t.ns_per_work > 0
            return ev(node_b, True, t.address)

        assert learn_a_then_ask_b() is True  # B unseen: its first node ends the range
        assert ev(None, False, t.address) is True  # ... and what the range took sets B's scale
        assert ev(node_b, True, t.address) is False  # B known: the range stays open
        t.forget_costs()
        t.reset()
        assert learn_a_then_ask_b() is True, "forget_costs kept op B's learned scale"
        """)


def test_cost_keys_are_op_and_work_bucket():
    """The learned scale is keyed by op *and* the log2 bucket of a node's work: after a small
    node of op B is learned, a same-bucket node of B keeps the range open, while a node of B
    a thousand times larger is a new key, ends its range and is learned on its own (the
    probes counter); a second large one then keeps the range open. Fake tensors as in the
    test above, in a subprocess for the same reason."""
    _python(FAKE_TENSORS + """
        node_a = ctypes.addressof(tensor((1000, 1, 1, 1), 5, COMPUTE))
        b_small = ctypes.addressof(tensor((1000, 1, 1, 1), 6, COMPUTE))    # work 2024: bucket 0
        b_small2 = ctypes.addressof(tensor((900, 1, 1, 1), 6, COMPUTE))    # work 1924: bucket 0
        b_large = ctypes.addressof(tensor((1000, 1000, 1, 1), 6, COMPUTE))  # work ~1e6: bucket 9

        ev = native._lib().cb_token_eval_reader
        t = native.CancelToken()
        t.set_slice_us(10_000_000)
        assert ev(node_a, True, t.address) is True and ev(None, False, t.address) is True  # sets the cost
        assert t.probes == 0
        assert ev(b_small, True, t.address) is True and ev(None, False, t.address) is True  # B small: a probe
        assert t.probes == 1
        assert ev(b_small2, True, t.address) is False  # same op, same bucket: known, the range stays open
        assert ev(b_large, True, t.address) is True, "a 1000x larger node of a known op was not a new key"
        assert ev(None, False, t.address) is True
        assert t.probes == 2
        assert ev(b_large, True, t.address) is False  # learned: the range stays open
        assert ev(None, False, t.address) is True
        assert t.probes == 2 and t.max_range_ns > 0 and t.max_range_cpu_ns >= 0
        assert t.take_max_range_ns() > 0 and t.max_range_ns == 0 == t.max_range_cpu_ns  # take: read, cleared
        t.reset()
        assert t.probes == 0  # a trial counter; the learned keys stay
        assert ev(b_large, True, t.address) is False and ev(b_small, True, t.address) is False
        """)
