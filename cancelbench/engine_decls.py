"""The built-in engines' declarations and the mechanisms they implement: pure data.

One home for what each built-in engine declares (phases, mechanisms, settings with
type, default and bounds: ``cancelbench.sut.declaration``), the same objects an
external engine sends as its hello. Config validation, the record's settings
columns (``cancelbench.schema``), the agent's engines and docs/cli.md's settings
tables read them here. Imports neither Ray, llama.cpp nor the device agents, so the
schema and the reports can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Callable

from cancelbench.sut.declaration import Declaration, MechanismInfo, Phase, Setting, SettingError
from cancelbench.sut.protocol import AUDIO_OUT


@dataclass(frozen=True)
class Mechanism:
    """How a cancel reaches the engine. Every mechanism checks the cancel flag
    before and after each native call (``CancelControl.call``); the flags say
    what it arms on top of that."""

    name: str
    abort_callback: bool = False  # the native abort reader on every llama context (llama_set_abort_callback)
    eval_hook: bool = False  # every graph runs on contexts whose scheduler polls the native eval reader
    chunked: bool = False  # prompt/prefill decoded in chunk_tokens batches instead of n_batch
    reaches: str = ""  # what it can stop inside, for docs and reports

    def prompt_step(self, n_batch: int, chunk_tokens: int) -> int:
        """Tokens per prompt decode under this mechanism."""
        return chunk_tokens if self.chunked else n_batch


MECHANISMS: dict[str, Mechanism] = {m.name: m for m in (
    Mechanism("between_calls", reaches="nothing inside a native call: the flag between calls"),
    Mechanism("abort_callback", abort_callback=True,
              reaches="llama_decode on backends that poll ggml's abort callback (upstream: CPU only); "
                      "not clip graphs"),
    Mechanism("chunked", chunked=True, reaches="nothing inside a call; shorter prompt calls"),
    Mechanism("graph_eval", eval_hook=True,
              reaches="every graph (llama_decode, clip encode, code predictor, code2wav) on every backend, "
                      "between node ranges of about graph_slice_us"),
)}
MECHANISM_NAMES = tuple(MECHANISMS)

# Settings, declared once (cancelbench.sut.declaration.Setting): config validation, the record's
# settings columns (cancelbench.schema) and docs/cli.md's tables are derived from these.
MAX_INT32 = 2**31 - 1
MAX_THREADS = 512  # ggml's GGML_MAX_N_THREADS
MAX_DURATION_US = 3_600_000_000  # one hour
MAX_SIM_US = 600_000_000  # sim engine: a phase's wait, ten minutes
MAX_SIM_STEPS = 100_000
MAX_SEED = 2**62 - 1
# graph_eval: the eval reader synchronizes the backend about this often (see cb_token_eval_reader in
# native/cancel_token.c); 0 = after every graph node. Re-exported by cancelbench.native.
DEFAULT_GRAPH_SLICE_US = 2000


def _llama_settings(n_batch: int, chunk_tokens: int) -> tuple[Setting, ...]:
    return (
        Setting("n_threads", "int", 2, 1, MAX_THREADS, "llama.cpp threads"),
        Setting("n_ctx", "int", 0, 0, MAX_INT32, "context size; 0: text max(512, prompt_tokens + max_tokens + 8), "
                "speech 2048"),
        Setting("n_batch", "int", n_batch, 1, MAX_INT32, "llama n_batch (tokens per prompt decode)"),
        Setting("n_ubatch", "int", None, 1, MAX_INT32, "llama n_ubatch; default n_batch, at most n_batch"),
        Setting("chunk_tokens", "int", chunk_tokens, 1, MAX_INT32, "chunked mechanism: tokens per prompt chunk"),
        Setting("n_gpu_layers", "int", None, -1, MAX_INT32,
                "layers offloaded to the device; default all on GPU devices, none on CPU"),
        Setting("use_extra_bufts", "bool", True, doc="llama.cpp weight repacking into extra CPU buffer types "
                "(AMX tiles on x86, ...); false where a host faults in it"),
        Setting("graph_slice_us", "int", DEFAULT_GRAPH_SLICE_US, 0, MAX_INT32,  # its int32 column's bound
                "graph_eval: eval-reader work per synchronized node range, us (0: every node)"),
    )


# Speech engines: where the projector's graphs run (llama.cpp's --no-mmproj-offload is false here).
_MMPROJ_OFFLOAD = Setting("mmproj_offload", "bool", True, doc="the projector's graphs (TTS code predictor and "
                          "code2wav, STT audio encoder) on the device with the model; false: on the CPU")


_LLAMA_MECHANISMS = tuple(MechanismInfo(m.name, m.reaches) for m in MECHANISMS.values())


def _declare(name: str, phases: tuple[str, ...], settings: tuple[Setting, ...], *, input: str = "text",
             step_phases: tuple[str, ...] | None = None, capabilities: tuple[str, ...] = ()) -> Declaration:
    steps = set(step_phases if step_phases is not None else phases)
    return Declaration(name=f"cancelbench-{name}", version=_version(), input=input,
                       phases=tuple(Phase(p, p in steps) for p in phases),
                       mechanisms=_LLAMA_MECHANISMS, settings=settings, capabilities=capabilities)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("cancelbench")
    except PackageNotFoundError:
        return "0+unknown"


DECLARATIONS: dict[str, Declaration] = {
    "text": _declare("text", ("prefill", "generate"), _llama_settings(256, 32) + (
        Setting("prompt_tokens", "int", 256, 1, MAX_INT32, "prompt tokenized, repeated/trimmed to exactly this"),
        Setting("max_tokens", "int", 16, 1, MAX_INT32, "generated tokens"),
    )),
    "tts": _declare("tts", ("set_input", "prompt", "generate", "code2wav", "output"), _llama_settings(256, 32) + (
        Setting("max_tokens", "int", 16, 1, MAX_INT32, "frame cap when max_frames is not given"),
        Setting("max_frames", "int", None, 1, MAX_INT32, "frame cap of one synthesis; default max_tokens"),
        Setting("lang", "string", "en", doc="language of an input whose corpus item names none"),
        Setting("top_k", "int", 50, 1, MAX_INT32, "sampling top-k"),
        Setting("temp", "float", 0.9, 0.0, 100.0, "sampling temperature", width="float64"),
        Setting("seed", "int", None, 0, MAX_SEED, "sampler seed (default: the sweep's seed)",
                column="sampling_seed", width="int64"), _MMPROJ_OFFLOAD,
    ), step_phases=("set_input", "prompt", "generate", "code2wav"),  # output steps only without a window left
        capabilities=(AUDIO_OUT,)),  # it hands each code2wav window's audio over as it is made
    "stt": _declare("stt", ("preprocess", "prefill", "encode", "decode_embd", "generate"), _llama_settings(256, 32) + (
        Setting("max_tokens", "int", 16, 1, MAX_INT32, "generated tokens"),
        Setting("system_prompt", "string", None, doc="system prompt (default none)"), _MMPROJ_OFFLOAD,
    ), input="audio_path"),
    "probe": _declare("probe", ("busy",), (
        Setting("duration_us", "int", 200_000, 1, MAX_DURATION_US, "busy-loop duration, us", width="int64"),
        Setting("period_us", "int", 1_000, 1, MAX_DURATION_US, "token check period, us", width="int64"),
    ), input="none"),
    "sim": _declare("sim", ("prefill", "generate"), (
        Setting("sim_phase_us", "int", 20_000, 1, MAX_SIM_US, "each phase's wait, us", width="int64"),
        Setting("sim_granularity_us", "int", 1_000, 1, MAX_SIM_US,
                "in-wait mechanisms check the token this often, us", width="int64"),
        Setting("sim_steps", "int", 4, 1, MAX_SIM_STEPS, "native waits in generate (and in chunked prefill)"),
    ), input="none"),
}


# -- resolution: the one place a built-in engine's settings get their values ----------------------
# Settings whose declared default is None (or n_ctx's 0) take a value that depends on another
# setting or on the device; every other default is the declaration's. The driver resolves a
# workload before the sweep (device unknown: n_gpu_layers stays None), the agent again with its
# device, and an engine's constructor takes what this returns and defaults nothing itself.
def _speech_ctx(s: dict) -> int:
    return 2048


def _text_ctx(s: dict) -> int:
    return max(512, s["prompt_tokens"] + s["max_tokens"] + 8)


_Derive = Callable[[dict], object]
_LLAMA_DERIVED: dict[str, _Derive] = {"n_ubatch": lambda s: s["n_batch"]}
_DERIVED: dict[str, dict[str, _Derive]] = {
    "text": {**_LLAMA_DERIVED, "n_ctx": _text_ctx},
    "tts": {**_LLAMA_DERIVED, "n_ctx": _speech_ctx, "max_frames": lambda s: s["max_tokens"],
            "seed": lambda s: 0},  # the sweep's default seed; a sweep sends its own
    "stt": {**_LLAMA_DERIVED, "n_ctx": _speech_ctx},
}


ALL_GPU_LAYERS = 999  # llama.cpp offloads min(n_gpu_layers, the model's layers)


def device_n_gpu_layers(device_id: str) -> int:
    """n_gpu_layers where a workload sets none: all layers on a GPU device, none on a CPU one."""
    return 0 if device_id.startswith("cpu") else ALL_GPU_LAYERS


def on_device(workload: dict, device_id: str) -> dict:
    """The workload with the device's default for an n_gpu_layers it leaves unset (all layers on
    a GPU, none on a CPU): a built-in engine's, or an external engine's where the driver found it
    declared to take that default (``device_settings``: a built-in engine out of process too)."""
    workload = dict(workload)
    if "settings" in workload:  # an external engine's table
        settings = workload["settings"] = dict(workload["settings"])
        for name in workload.get("device_settings", ()):
            if settings.get(name) is None:
                settings[name] = device_n_gpu_layers(device_id)
        for name in workload.get("sweep_settings", ()):  # 1.4: a declared seed with no default: the sweep's
            if settings.get(name) is None and workload.get(name) is not None:
                settings[name] = workload[name]
    elif workload.get("n_gpu_layers") is None:
        workload["n_gpu_layers"] = device_n_gpu_layers(device_id)
    return workload


def resolve_settings(kind: str, given: dict, where: str, device_id: str | None = None) -> dict:
    """Every setting of built-in engine ``kind``: ``given``'s value (checked; keys that are not
    settings, such as model paths, ignored), else the declared default, else the derived value;
    then what no single setting says (n_ubatch <= n_batch; a text prompt and its output fit n_ctx).
    ``device_id`` None leaves n_gpu_layers None for the agent to resolve. SettingError, one line."""
    decl = DECLARATIONS[kind]
    names = {s.name for s in decl.settings}
    s = decl.resolve({k: v for k, v in given.items() if k in names and v is not None}, where)
    for name, derive in _DERIVED.get(kind, {}).items():
        if s[name] is None or (name == "n_ctx" and s[name] == 0):
            s[name] = derive(s)
    if "n_gpu_layers" in s and s["n_gpu_layers"] is None and device_id is not None:
        s["n_gpu_layers"] = device_n_gpu_layers(device_id)
    if "n_ubatch" in s and s["n_ubatch"] > s["n_batch"]:
        raise SettingError(f"{where}: n_ubatch ({s['n_ubatch']}) must be <= n_batch ({s['n_batch']})")
    if "prompt_tokens" in s and s["prompt_tokens"] + s["max_tokens"] > s["n_ctx"]:
        raise SettingError(f"{where}: prompt_tokens + max_tokens ({s['prompt_tokens'] + s['max_tokens']}) "
                           f"exceeds n_ctx {s['n_ctx']}")
    return s


def settings_record(kind: str, settings: dict) -> dict:
    """Resolved settings under their record columns (a TTS ``seed`` is ``sampling_seed``)."""
    return {s.record_column: settings[s.name] for s in DECLARATIONS[kind].settings}


def builtin_settings() -> dict[str, Setting]:
    """Every built-in engine's settings, once each (from the declarations as they are now); a name
    two engines share must mean the same type there."""
    out: dict[str, Setting] = {}
    for decl in DECLARATIONS.values():
        for s in decl.settings:
            assert out.setdefault(s.name, s).type == s.type, s.name
    return out


def typed_columns(settings: dict, declaration: Declaration) -> dict:
    """An external engine's effective ``settings`` as the built-in settings' typed record columns: a
    setting it declares with a built-in setting's name and type fills that setting's column (``n_threads``,
    a ``seed``'s ``sampling_seed``), if its value is one the built-in setting allows (bounds, the
    column's width: every built-in bound fits its column). Every other setting stays in
    engine_settings_json alone."""
    out, builtins = {}, builtin_settings()
    for name, value in settings.items():
        builtin, declared = builtins.get(name), declaration.setting(name)
        if builtin is None or declared is None or declared.type != builtin.type or value is None:
            continue
        try:
            out[builtin.record_column] = builtin.check(value, name)
        except SettingError:
            continue
    return out


DOCS_BEGIN = "<!-- engine settings: generated from cancelbench/engine_decls.py by `python -m cancelbench.engine_decls` -->"
DOCS_END = "<!-- end of engine settings -->"


def settings_markdown() -> str:
    """docs/cli.md's settings tables, one per built-in engine, between DOCS_BEGIN and DOCS_END."""
    from cancelbench.sut.declaration import render_settings_table

    parts = [DOCS_BEGIN]
    for name, decl in DECLARATIONS.items():
        phases = ", ".join(f"`{p.name}`" for p in decl.phases)
        parts.append(render_settings_table(decl, f"engine = \"{name}\"") +
                     f"\n\nPhases: {phases}; input: {decl.input}.")
    parts.append(DOCS_END)
    return "\n\n".join(parts) + "\n"


def update_docs(path) -> None:
    """Rewrite the generated block of ``path`` (docs/cli.md) in place."""
    from pathlib import Path

    text = Path(path).read_text()
    start, end = text.index(DOCS_BEGIN), text.index(DOCS_END) + len(DOCS_END) + 1
    Path(path).write_text(text[:start] + settings_markdown() + text[end:])


if __name__ == "__main__":
    import sys

    update_docs(sys.argv[1] if len(sys.argv) > 1 else "docs/cli.md")
