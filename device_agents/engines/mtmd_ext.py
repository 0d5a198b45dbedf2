"""What the speech engines need from libmtmd beyond ``llama_cpp.mtmd_cpp``.

llama-cpp-python 0.3.36 already binds everything the engines call
(``mtmd_context_params.cb_eval``/``batch_max_tokens``, the gen-audio helper,
``mtmd_gen_audio_process``, ``mtmd_encode_chunk``, ``llama_batch_ext``), so this
module holds no new symbol declarations; it holds the glue:

* :func:`init_mtmd` — an mtmd context with an optional *native* ``cb_eval``
  (``cb_token_eval_reader`` from the cancel-token library, so no Python runs on
  the compute thread; it syncs about every ``graph_slice_us``, see cancel_token.c). mtmd hands ``cb_eval`` to every clip context it creates
  (``mtmd.cpp``: ``clip_context_params.cb_eval``; ``clip.cpp``:
  ``ggml_backend_sched_set_eval_callback``), which is the only way to stop a
  clip graph (audio encode, code predictor, code2wav) from outside: llama's
  abort callback never reaches clip's own scheduler.
* :func:`bind_token` — points a trial's :class:`CancelControl` at the token the
  clip scheduler was given at init (``cb_eval_user_data`` is fixed for the
  context's lifetime, a trial's token is not).
* :func:`reseed_clip_rng` — clip reseeds its sampling RNG only when the seed
  *changes* (``clip.cpp`` clip_encode: ``if (params->seed != ctx->rng_seed)``),
  so two runs with the same seed on one context draw different codes. A
  GEN_CODE call with another seed and an out-of-range ``code0`` reseeds and then
  fails the bounds check before any compute, so the next real call reseeds to
  the trial's seed: same seed, same audio.
* :func:`read_gguf_tensor_shapes` — tensor shapes from a GGUF header
  (``gguf.GGUFReader``, no load); an mmproj's projector types are checked by
  ``model_check`` (the driver's and the agent's one rule).
* :func:`quiet_mtmd_logs` — route libmtmd/clip logs away from stderr.
"""

from __future__ import annotations

import ctypes
import threading
import wave
from pathlib import Path

import llama_cpp
from llama_cpp import mtmd_cpp as M

from cancelbench import native
from cancelbench.device_agents import model_check

from . import llama_runtime as rt
from .base import CancelControl, EngineInputError

# The native eval reader (a raw C function pointer, llama_runtime.NATIVE_EVAL_READER):
# the clip scheduler computes the graph in node ranges of about one slice,
# synchronizes after each and stops the split once the token is set.
NATIVE_EVAL_READER = rt.NATIVE_EVAL_READER


@llama_cpp.llama_log_callback
def _silent(level, text, user_data):  # pragma: no cover - native callback
    return None


_quiet_once = threading.Lock()
_quieted = False


def quiet_mtmd_logs() -> None:
    """Send libmtmd / clip / helper logs nowhere (mtmd_helper_log_set covers all three)."""
    global _quieted
    with _quiet_once:
        if not _quieted:
            M.mtmd_helper_log_set(_silent, None)
            _quieted = True


def init_mtmd(mmproj: Path, model, *, n_threads: int, use_gpu: bool,
              eval_token: native.CancelToken | None = None, warmup: bool = True):
    """mtmd_init_from_file with the cancel hook (``eval_token``) or without it."""
    params = M.mtmd_context_params_default()
    params.use_gpu = bool(use_gpu)
    params.n_threads = int(n_threads)
    params.print_timings = False
    params.warmup = bool(warmup)
    if eval_token is not None:
        params.cb_eval = NATIVE_EVAL_READER
        params.cb_eval_user_data = ctypes.c_void_p(eval_token.address)
    ctx = M.mtmd_init_from_file(str(mmproj).encode(), model, params)
    if not ctx:
        raise EngineInputError(f"libmtmd could not load the mmproj {mmproj} for this model "
                               "(wrong projector for the text model, or a truncated file)")
    return ctx


def bind_token(ctl: CancelControl, token: native.CancelToken,
               slice_us: int = native.DEFAULT_GRAPH_SLICE_US) -> None:
    """Make ``token`` the trial's cancel token (a cancel already received stays latched),
    polled with the workload's ``graph_slice_us``.

    ``cb_eval_user_data`` is fixed when the mtmd context is created, so the clip
    scheduler polls the engine's own token; the trial's cancel must set that one.
    The swap happens under the control's lock, so it cannot interleave with
    :meth:`CancelControl.request`.
    """
    rt.bind_graph_token(ctl, token, slice_us)


def reseed_clip_rng(mctx, n_embd: int, seed: int) -> int:
    """Force clip's gen RNG to be reseeded with ``seed`` on the next gen call (see module doc).

    Returns the rc of the probe call (1 = rejected by the code0 bounds check, as intended).
    """
    if seed == 0xFFFFFFFF:
        return 0
    zeros = (ctypes.c_float * int(n_embd))()
    inp = M.mtmd_gen_inp_default(mctx)
    inp.type = M.MTMD_GEN_PROCESS_TYPE_GEN_CODE
    inp.code0 = -1                      # rejected before compute
    inp.embd = zeros
    inp.seed = (int(seed) + 1) & 0xFFFFFFFF
    if inp.seed == 0xFFFFFFFF:
        inp.seed = 0
    out = M.mtmd_gen_out()
    return int(M.mtmd_gen_audio_process(mctx, ctypes.byref(inp), ctypes.byref(out)))


# --------------------------------------------------------------------------- GGUF header reading

def _gguf_reader(path: Path):
    """gguf.GGUFReader over ``path`` (memory-mapped; tensor data is not read)."""
    from gguf import GGUFReader  # pinned dependency; imported here, only header checks need it

    path = Path(path)
    try:
        return GGUFReader(path, "r")
    except (ValueError, IndexError, OSError) as exc:
        raise EngineInputError(f"{path} is not a readable GGUF file ({exc})") from None


def read_gguf_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: ggml ne} from a GGUF header (no data read)."""
    return {t.name: tuple(int(x) for x in t.shape) for t in _gguf_reader(path).tensors}


def check_mmproj(mmproj: Path | None, *, engine: str) -> Path:
    """Clear errors for a missing mmproj or one that does not fit ``engine``
    (the same rule the driver and the agent apply: model_check)."""
    if not mmproj:
        raise EngineInputError(f"the {engine} engine needs an mmproj (workload key 'mmproj')")
    path = Path(mmproj)
    if not path.is_file():
        raise EngineInputError(f"mmproj file not found: {path}")
    try:
        model_check.check_model(path, engine, "mmproj")
    except model_check.ModelMismatchError as exc:
        raise EngineInputError(str(exc)) from None
    return path


# --------------------------------------------------------------------------- audio files

def write_wav16(path: Path, pcm, sample_rate: int) -> Path:
    """16-bit mono PCM WAV (same conversion as mtmd-helper-gen.cpp write_wav16)."""
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    x = np.clip(np.asarray(pcm, dtype=np.float32), -1.0, 1.0)
    data = (x * 32767.0).astype("<i2").tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(data)
    return path


def read_wav_mono_f32(path: Path, expected_rate: int):
    """Read a WAV as float32 mono samples; clear errors for what the encoder cannot take."""
    import numpy as np

    path = Path(path)
    if not path.is_file():
        raise EngineInputError(f"audio file not found: {path}")
    try:
        with wave.open(str(path), "rb") as w:
            rate, ch, width, n = w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getnframes()
            raw = w.readframes(n)
    except (wave.Error, EOFError) as exc:
        raise EngineInputError(f"{path}: not a PCM WAV file ({exc})") from None
    if rate != expected_rate:
        raise EngineInputError(f"{path.name}: sample rate {rate} Hz is not supported; "
                               f"this encoder takes {expected_rate} Hz mono")
    if ch != 1:
        raise EngineInputError(f"{path.name}: {ch} channels; this encoder takes mono audio")
    if width != 2:
        raise EngineInputError(f"{path.name}: {8 * width}-bit samples; expected 16-bit PCM")
    if n == 0:
        raise EngineInputError(f"{path.name}: empty audio")
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


