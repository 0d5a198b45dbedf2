"""Thin helpers over llama-cpp-python's low-level API shared by the engines."""

from __future__ import annotations

import ctypes
import sys
import threading
from pathlib import Path

import llama_cpp

from cancelbench import native

from .base import EngineInputError

_backend_lock = threading.Lock()
_backend_ready = False


def ensure_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            llama_cpp.llama_backend_init()
            _backend_ready = True


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


def load_model(path: Path, n_gpu_layers: int) -> llama_cpp.llama_model_p:
    ensure_backend()
    mparams = llama_cpp.llama_model_default_params()
    mparams.n_gpu_layers = int(n_gpu_layers)
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise EngineInputError(f"llama.cpp could not load {path} (truncated or unsupported GGUF?)")
    return model


def new_context(model, *, n_ctx: int, n_batch: int, n_ubatch: int, n_threads: int,
                offload: bool) -> llama_cpp.llama_context_p:
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = int(n_ctx)
    cparams.n_batch = int(n_batch)
    cparams.n_ubatch = int(n_ubatch)
    cparams.n_threads = int(n_threads)
    cparams.n_threads_batch = int(n_threads)
    cparams.no_perf = True
    cparams.op_offload = bool(offload)
    cparams.offload_kqv = bool(offload)
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    if not ctx:
        raise EngineInputError("llama.cpp could not create a context (n_ctx/n_batch too large?)")
    return ctx


# The native reader as a ggml_abort_callback value: a raw C function pointer,
# so no Python runs on the compute thread when llama.cpp polls it.
NATIVE_ABORT_READER = llama_cpp.ggml_abort_callback(native.reader_address())


def arm_abort(ctx, token: native.CancelToken | None) -> None:
    """Install (token given) or remove (None) the native abort reader on ``ctx``."""
    if token is None:
        llama_cpp.llama_set_abort_callback(ctx, llama_cpp.ggml_abort_callback(0), None)
    else:
        llama_cpp.llama_set_abort_callback(ctx, NATIVE_ABORT_READER, ctypes.c_void_p(token.address))


def tokenize(vocab, text: str, add_special: bool = True) -> list[int]:
    data = text.encode("utf-8")
    n_max = len(data) + 8
    buf = (llama_cpp.llama_token * n_max)()
    n = llama_cpp.llama_tokenize(vocab, data, len(data), buf, n_max, add_special, False)
    if n < 0:
        raise EngineInputError(f"tokenization needs {-n} tokens, more than {n_max}")
    return list(buf[:n])


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
