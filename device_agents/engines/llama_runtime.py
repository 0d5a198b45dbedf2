"""Thin helpers over llama-cpp-python's low-level API shared by the engines."""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import llama_cpp

from cancelbench import native

from .base import CancelControl, EngineInputError

_backend_lock = threading.Lock()
_backend_ready = False


def ensure_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            try:
                calibrate_eval_reader()
            except (ImportError, AttributeError, OSError):  # another ggml: every node then weighs 1
                pass
            _backend_ready = True


class _GgmlInitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def calibrate_eval_reader() -> bool:
    """Show the native eval reader three real (unallocated) tensors of the loaded ggml,
    so it can weigh graph nodes by their shapes (cancel_token.c, cb_eval_calibrate)."""
    from llama_cpp._ggml import libggml

    p = ctypes.c_void_p
    libggml.ggml_init.restype = p
    libggml.ggml_init.argtypes = [_GgmlInitParams]
    libggml.ggml_new_tensor_2d.restype = p
    libggml.ggml_new_tensor_2d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    libggml.ggml_mul_mat.restype = p
    libggml.ggml_mul_mat.argtypes = [p, p, p]
    libggml.ggml_free.restype = None
    libggml.ggml_free.argtypes = [p]
    for fn in ("ggml_set_input", "ggml_set_output"):
        getattr(libggml, fn).restype = None
        getattr(libggml, fn).argtypes = [p]
    libggml.ggml_graph_overhead_custom.restype = ctypes.c_size_t
    libggml.ggml_graph_overhead_custom.argtypes = [ctypes.c_size_t, ctypes.c_bool]
    libggml.ggml_new_graph_custom.restype = p
    libggml.ggml_new_graph_custom.argtypes = [p, ctypes.c_size_t, ctypes.c_bool]
    libggml.ggml_build_forward_expand.restype = None
    libggml.ggml_build_forward_expand.argtypes = [p, p]
    libggml.ggml_new_tensor_3d.restype = p
    libggml.ggml_new_tensor_3d.argtypes = [p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    f = ctypes.c_float
    libggml.ggml_flash_attn_ext.restype = p
    libggml.ggml_flash_attn_ext.argtypes = [p, p, p, p, p, f, f, f]
    mem = (1 << 16) + libggml.ggml_graph_overhead_custom(16, False)
    ctx = libggml.ggml_init(_GgmlInitParams(mem, None, True))
    if not ctx:
        return False
    try:
        k, m, n = 48, 80, 7
        a = libggml.ggml_new_tensor_2d(ctx, 0, k, m)  # GGML_TYPE_F32
        b = libggml.ggml_new_tensor_2d(ctx, 0, k, n)
        mm = libggml.ggml_mul_mat(ctx, a, b)
        libggml.ggml_set_input(a)
        libggml.ggml_set_output(mm)
        if not native.calibrate_eval_reader(a, b, mm, k, m, n):
            return False
        before = native.node_work(mm)  # not in a graph yet: not computed, weighs its dispatch alone
        libggml.ggml_build_forward_expand(libggml.ggml_new_graph_custom(ctx, 16, False), mm)
        if not (before <= 1024 < m * n * k < native.node_work(mm)):
            return False
        q = libggml.ggml_new_tensor_3d(ctx, 1, 64, 8, 2)  # GGML_TYPE_F16: head dim, tokens, heads
        kv = [libggml.ggml_new_tensor_3d(ctx, 1, 64, 32, 2) for _ in range(2)]
        fa = libggml.ggml_flash_attn_ext(ctx, q, kv[0], kv[1], None, 0.125, 0.0, 0.0)
        return native.calibrate_eval_reader_flash_attn(q, kv[0], fa) and _calibrate_no_ops(ctx, a, k, m)
    finally:
        libggml.ggml_free(ctx)


def _calibrate_no_ops(ctx, a: int, k: int, m: int) -> bool:
    """The ops that move no data (ggml_op_is_empty), each shown to the reader as a real tensor of
    the loaded ggml: a view of a large weight costs what a view of a small one does."""
    from llama_cpp._ggml import libggml

    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    sigs = {"ggml_reshape_1d": [p, p, i64], "ggml_view_1d": [p, p, i64, ctypes.c_size_t],
            "ggml_permute": [p, p, i32, i32, i32, i32], "ggml_transpose": [p, p]}
    for name, argtypes in sigs.items():
        getattr(libggml, name).restype = p
        getattr(libggml, name).argtypes = argtypes
    views = (libggml.ggml_reshape_1d(ctx, a, k * m), libggml.ggml_view_1d(ctx, a, k, 0),
             libggml.ggml_permute(ctx, a, 1, 0, 2, 3), libggml.ggml_transpose(ctx, a))
    return all(native.calibrate_eval_reader_no_op(a, v) for v in views)


GGML_LOG_LEVEL_ERROR = 4


def quiet_logs() -> None:
    """Keep llama.cpp/ggml errors on stderr, drop their info chatter (the agent's
    output stays readable). Call before the first ggml backend use."""
    from llama_cpp import _logger  # noqa: F401  (installs llama-cpp-python's log callback first)

    llama_cpp.llama_log_set(_errors_only_log, ctypes.c_void_p(0))


# llama.cpp logs an abort requested by the abort callback (GGML_STATUS_ABORTED,
# llama_decode -> 2) as three errors; for cancelbench that is the expected outcome,
# recorded as decode_rc = 2, so these lines are dropped.
_ABORT_LINES = ("compute_async failed with error 1", "compute status: 1", "failed to decode, ret = 2")


@llama_cpp.llama_log_callback
def _errors_only_log(level, text, user_data):  # pragma: no cover - native callback
    if level == GGML_LOG_LEVEL_ERROR and text:
        line = text.decode("utf-8", "replace")
        if not any(marker in line for marker in _ABORT_LINES):
            sys.stderr.write(line)


def check_gguf(path: Path, what: str = "model") -> Path:
    """Fail early, with a one-line reason, on a missing or non-GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise EngineInputError(f"{what} file not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise EngineInputError(f"{what} file {path} is not a GGUF file (magic {magic!r})")
    return path


def load_model(path: Path, n_gpu_layers: int, use_extra_bufts: bool = True) -> llama_cpp.llama_model_p:
    ensure_backend()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = int(n_gpu_layers)
    mparams.use_extra_bufts = bool(use_extra_bufts)  # weight repacking (AMX, ...): llama.cpp's default is on
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise EngineInputError(f"llama.cpp could not load {path} (truncated or unsupported GGUF?)")
    return model


def new_context(model, *, n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int,
                offload: bool, eval_token: native.CancelToken | None = None,
                embeddings: bool = False) -> llama_cpp.llama_context_p:
    """A llama context; with ``eval_token`` its scheduler runs the native eval reader
    (graph_eval): ``cb_eval_user_data`` is fixed for the context's life, so the
    caller keeps that token alive and binds each trial to it (:func:`bind_graph_token`)."""
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = int(n_ctx)
    cparams.n_batch = int(n_batch)
    cparams.n_ubatch = int(n_ubatch)
    cparams.n_threads = int(n_threads)
    cparams.n_threads_batch = int(n_threads)
    cparams.no_perf = True
    cparams.op_offload = bool(offload)
    cparams.offload_kqv = bool(offload)
    if embeddings:  # per-token hidden states (the TTS talker's, for step_gen; tools/tts/tts.cpp does the same)
        cparams.embeddings = True
        cparams.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_NONE
    if eval_token is not None:
        cparams.cb_eval = NATIVE_EVAL_READER
        cparams.cb_eval_user_data = ctypes.c_void_p(eval_token.address)
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise EngineInputError("llama.cpp could not create a context (n_ctx/n_batch too large?)")
    return ctx


# The native readers as ctypes callback values (raw C function pointers), so no
# Python runs on the compute thread when llama.cpp / ggml call them.
NATIVE_ABORT_READER = llama_cpp.ggml_abort_callback(native.reader_address())
# ggml_backend_sched_eval_callback: the scheduler computes the nodes it was not
# asked to show as one range, synchronizes after each range the reader asked to
# see, and stops the split once the token is set (cancel_token.c).
NATIVE_EVAL_READER = llama_cpp.ggml_backend_sched_eval_callback(native.eval_reader_address())


def bind_graph_token(ctl: CancelControl, token: native.CancelToken, slice_us: int) -> None:
    """Make ``token`` (the one a hooked context polls) the trial's cancel token, with the
    workload's slice. A cancel already received stays latched (CancelControl.adopt_token)."""
    if token.slice_us != slice_us:
        token.set_slice_us(slice_us)
    ctl.adopt_token(token)


def arm_abort(ctx, token: native.CancelToken | None) -> None:
    """Install (token given) or remove (None) the native abort reader on ``ctx``."""
    if token is None:
        llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(0), None)
    else:
        llama_cpp.llama_set_abort_callback(ctx, NATIVE_ABORT_READER, ctypes.c_void_p(token.address))


def tokenize(vocab, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
    """Token ids of ``text``. A vocabulary can yield more tokens than the text has
    bytes (byte fallback for a piece it lacks): llama_tokenize then returns minus
    the count it needs, and the call is repeated with exactly that size."""
    data = text.encode("utf-8")
    n_max = len(data) + 8
    for _ in range(2):
        buf = (llama_cpp.llama_token * n_max)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n >= 0:
            return list(buf[:n])
        if n == -(2**31):  # INT32_MIN: the count overflows int32
            break
        n_max = -n
    raise EngineInputError(f"llama_tokenize could not tokenize a text of {len(data)} bytes (rc {n})")


class Batch:
    """A reusable llama_batch filled for sequence 0."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.batch = llama_cpp.llama_batch_init(capacity, 0, 1)

    def fill(self, tokens: list[int], pos0: int, logits_last: bool) -> llama_cpp.llama_batch:
        b = self.batch
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        for i, tok in enumerate(tokens):
            b.token[i] = tok
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if (logits_last and i == n - 1) else 0
        b.n_tokens = n
        return b

    def free(self) -> None:
        if self.batch is not None:
            llama_cpp.llama_batch_free(self.batch)
            self.batch = None
