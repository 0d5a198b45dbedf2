"""Settings have one home: the declarations (cancelbench/engine_decls.py) resolve every
built-in engine's settings, and the engines hold no default of their own.

Before this home, TTS declared n_batch 256 and defaulted 32 in its constructor, so a
TTS engine built outside a sweep ran other settings than the record said, and a TTS
row's max_tokens column held max_frames."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cancelbench.engine_decls import DECLARATIONS, device_n_gpu_layers, resolve_settings, settings_record
from cancelbench.sut.declaration import SettingError

ENGINES_DIR = Path(__file__).resolve().parents[1] / "device_agents" / "engines"
# what an engine may read off its workload itself: the verified files, not settings
FILE_KEYS = {"model", "mmproj"}


def _workload_reads(path: Path) -> list[tuple[int, str]]:
    """(line, what) of every ``workload.get(...)``/``workload[...]`` in ``path`` that is not a file key."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "workload"):
            key = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else "?"
        elif (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "workload"):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else "?"
        if key is not None and key not in FILE_KEYS:
            out.append((node.lineno, str(key)))
    return out


def test_no_built_in_engine_reads_a_setting_off_its_workload(tmp_path):
    """Every setting reaches an engine through engine_settings (the declarations' resolution):
    an engine that read ``workload.get("n_batch", 32)`` again would hold a default of its own."""
    # the protocol's adapters forward a workload's settings to a process that resolves them: no engine
    modules = [p for p in sorted(ENGINES_DIR.glob("*.py"))
               if p.name not in ("external.py", "builtin_child.py", "__init__.py")]
    assert {"text.py", "tts.py", "stt.py", "sim.py", "base.py", "llama_base.py"} <= {p.name for p in modules}
    found = {p.name: _workload_reads(p) for p in modules}
    assert not {k: v for k, v in found.items() if v}, found
    # the scan finds such reads (so the assertion above can fail)
    case = tmp_path / "case.py"
    case.write_text('def f(workload):\n    return workload.get("n_batch", 32), workload["model"], workload["top_k"]\n')
    assert _workload_reads(case) == [(2, "n_batch"), (2, "top_k")]


@pytest.mark.parametrize("kind", sorted(DECLARATIONS))
def test_every_setting_resolves_to_a_value_and_checks(kind):
    """Declared defaults and derived values: nothing None but what the device or a corpus decides."""
    s = resolve_settings(kind, {}, "w", device_id="cpu0")
    decl = DECLARATIONS[kind]
    assert set(s) == {x.name for x in decl.settings}
    undecided = {k for k, v in s.items() if v is None}
    assert undecided <= {"system_prompt"}, undecided  # none: no system prompt
    for x in decl.settings:
        if x.default is not None and not (x.name == "n_ctx" and x.default == 0):
            assert s[x.name] == x.default, x.name
    with pytest.raises(SettingError, match="is not a setting"):
        DECLARATIONS[kind].resolve({"no_such_setting": 1}, "w")
    # keys that are not settings (files, names) pass through resolution unread
    assert resolve_settings(kind, {"model": "m.gguf", "name": "x"}, "w", device_id="cpu0") == s


def test_derived_values_follow_the_settings_they_come_from():
    tts = resolve_settings("tts", {"max_tokens": 7, "n_batch": 64}, "w")
    assert (tts["max_frames"], tts["n_ubatch"], tts["n_ctx"]) == (7, 64, 2048)
    assert tts["n_gpu_layers"] is None  # the driver does not know the device: the agent resolves it
    assert resolve_settings("tts", {"max_frames": 5, "max_tokens": 7}, "w")["max_frames"] == 5
    text = resolve_settings("text", {"prompt_tokens": 1000, "max_tokens": 40}, "w")
    assert text["n_ctx"] == 1048
    assert resolve_settings("text", {}, "w")["n_ctx"] == 512
    assert resolve_settings("text", {"n_gpu_layers": None}, "w", device_id="vulkan0")["n_gpu_layers"] \
        == device_n_gpu_layers("vulkan0") > 0
    assert resolve_settings("stt", {}, "w", device_id="cpu0")["n_gpu_layers"] == 0


@pytest.mark.parametrize("given, message", [
    ({"n_batch": 32, "n_ubatch": 64}, r"n_ubatch \(64\) must be <= n_batch \(32\)"),
    ({"prompt_tokens": 500, "max_tokens": 20, "n_ctx": 512}, r"prompt_tokens \+ max_tokens \(520\) exceeds n_ctx 512"),
    ({"n_batch": 0}, r"n_batch must be >= 1"),
    ({"graph_slice_us": -1}, r"graph_slice_us must be >= 0"),
    ({"graph_slice_us": 3_000_000_000}, r"graph_slice_us must be <= 2147483647, got 3000000000"),
])
def test_what_no_single_setting_says_is_checked_once(given, message):
    with pytest.raises(SettingError, match=message):
        resolve_settings("text", given, "workload w")


def test_a_config_refuses_what_the_engine_would():
    """The cross-checks run before the sweep, from the same function the engines use."""
    from orchestrator.checks import ConfigError
    from orchestrator.config import parse_config

    data = {"workload": [{"name": "w", "engine": "text", "prompt_tokens": 600, "max_tokens": 16, "n_ctx": 512}]}
    with pytest.raises(ConfigError, match=r"exceeds n_ctx 512"):
        parse_config(data)


def test_settings_record_names_columns_and_keeps_every_setting():
    """A TTS seed is its sampling_seed column; max_tokens is max_tokens (not max_frames)."""
    s = resolve_settings("tts", {"max_tokens": 9, "max_frames": 4, "seed": 3}, "w", device_id="cpu0")
    rec = settings_record("tts", s)
    assert (rec["max_tokens"], rec["max_frames"], rec["sampling_seed"]) == (9, 4, 3)
    assert "seed" not in rec and len(rec) == len(DECLARATIONS["tts"].settings)


def test_a_sim_and_probe_engine_describe_every_declared_setting():
    """The engines' own describe() (the record's settings columns) comes from the resolution:
    a setting added to a declaration is in it without editing the engine."""
    from cancelbench.device_agents.engines.sim import SimEngine
    from cancelbench.device_agents.engines.text import ProbeEngine

    sim = SimEngine({"sim_steps": 3})
    assert sim.describe() == {"engine": "sim", "sim_phase_us": 20_000, "sim_granularity_us": 1_000, "sim_steps": 3}
    probe = ProbeEngine({"period_us": 500})
    assert probe.describe() == {"engine": "probe", "duration_us": 200_000, "period_us": 500}


def test_the_device_default_reaches_built_in_and_declaring_external_engines():
    """The agent's device default for an unset n_gpu_layers: a built-in engine's key, an external
    engine's settings where the driver found it declared to take it, never a value a workload set."""
    from cancelbench.engine_decls import ALL_GPU_LAYERS, on_device

    assert on_device({"engine": "text"}, "vulkan0")["n_gpu_layers"] == ALL_GPU_LAYERS
    assert on_device({"engine": "text", "n_gpu_layers": 3}, "vulkan0")["n_gpu_layers"] == 3
    assert on_device({"engine": "text", "n_gpu_layers": None}, "cpu0")["n_gpu_layers"] == 0
    ext = {"engine": "external", "settings": {"n_gpu_layers": None, "n_threads": 2}, "device_settings": ["n_gpu_layers"]}
    assert on_device(ext, "cuda0")["settings"] == {"n_gpu_layers": ALL_GPU_LAYERS, "n_threads": 2}
    assert ext["settings"]["n_gpu_layers"] is None  # the driver's payload is not changed
    undeclared = {"engine": "external", "settings": {"n_gpu_layers": None}, "device_settings": []}
    assert on_device(undeclared, "cuda0")["settings"] == {"n_gpu_layers": None}


@pytest.mark.parametrize("setting, takes", [
    ({"name": "n_gpu_layers", "type": "int", "default": None, "min": -1, "max": 100000}, True),
    ({"name": "n_gpu_layers", "type": "int", "default": None}, True),
    ({"name": "n_gpu_layers", "type": "int", "default": 0}, False),  # the engine's own default
    ({"name": "n_gpu_layers", "type": "int", "default": None, "min": 0, "max": 40}, False),  # 999 out of bounds
    ({"name": "n_gpu_layers", "type": "bool", "default": None}, False),
])
def test_an_external_engine_takes_the_device_default_only_where_its_declaration_admits_it(setting, takes):
    import dataclasses

    from orchestrator.workloads import WorkloadSpec
    from cancelbench.sut.declaration import Declaration

    decl = Declaration.from_hello({"type": "hello", "protocol": 1, "engine": {"name": "e", "version": "1"},
                                   "clock": "monotonic", "input": "text", "phases": [{"name": "p", "steps": False}],
                                   "mechanisms": [{"name": "between_calls", "reaches": ""}], "settings": [setting]})
    spec = dataclasses.replace(WorkloadSpec(name="w", engine="external", command=("e",), model=None), declaration=decl)
    assert spec.engine_params()["device_settings"] == (["n_gpu_layers"] if takes else [])


def test_every_integer_setting_fits_its_record_column():
    """A declared bound the column cannot hold made every record of such a trial unwritable as Parquet
    (graph_slice_us admitted 3.6e9 into an int32 column: the sweep kept them in an unwritten-*.jsonl)."""
    from cancelbench.engine_decls import builtin_settings
    from cancelbench.schema import RECORD_SCHEMA

    widths = {"int32": (-(1 << 31), (1 << 31) - 1), "int64": (-(1 << 63), (1 << 63) - 1)}
    ints = [s for s in builtin_settings().values() if s.type == "int"]
    assert len(ints) > 10
    for s in ints:
        lo, hi = widths[str(RECORD_SCHEMA.field(s.record_column).type)]
        assert s.min is not None and s.max is not None and lo <= s.min <= s.max <= hi, (s.name, s.min, s.max)
