"""Writing fixture GGUFs: reproducible random weights, streamed to disk one tensor at a time.

Every recipe (text, TTS, ASR, field scale) adds its keys and tensors to a
:class:`FixtureWriter`. Weights are :class:`Lazy` tensors: a shape, a dtype and
a function that draws them from raw PCG64 bits (``random_raw``, stable across
numpy versions). The writer lays out the header from the shapes alone, then
generates, optionally quantizes (Q8_0) and writes each tensor in the order it
was added, so the random stream is consumed exactly as an eager writer would
and peak memory stays near one tensor. ``data=False`` writes the header and a
sparse, zero-filled data section: a full-size file ``gguf.GGUFReader`` reads
(tensor shapes, keys) without drawing a single weight.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cancelbench.fileio import atomic_path

_CHUNK = 1 << 22  # random values drawn per step; the stream is the same for any chunk size
Q8_BLOCK, Q8_BYTES = 32, 34  # ggml's Q8_0: 32 weights -> one f16 scale + 32 int8


@dataclass(frozen=True)
class Lazy:
    """A tensor not generated yet."""

    shape: tuple[int, ...]
    dtype: np.dtype
    make: Callable[[], np.ndarray]

    def astype(self, dtype) -> Lazy:
        return Lazy(self.shape, np.dtype(dtype), lambda: self.make().astype(dtype))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


class Rng:
    """Uniform weights from raw PCG64 output; every method returns a :class:`Lazy`."""

    def __init__(self, seed: int) -> None:
        self.bg = np.random.PCG64(seed)

    def _draw(self, shape: tuple[int, ...], scale: float, lo: float | None) -> np.ndarray:
        n = int(np.prod(shape))
        out = np.empty(n, dtype=np.float32)
        for start in range(0, n, _CHUNK):
            m = min(_CHUNK, n - start)
            raw = self.bg.random_raw(m) >> np.uint64(40)  # 24 random bits
            u = raw.astype(np.float64) / float(1 << 24)
            out[start:start + m] = (u * 2.0 - 1.0) * scale if lo is None else lo + u * (scale - lo)
        return out.reshape(shape)

    def uniform(self, shape: tuple[int, ...], scale: float, lo: float | None = None) -> Lazy:
        """Uniform(-scale, scale), or Uniform(lo, scale) when ``lo`` is given, as float32."""
        shape = tuple(int(d) for d in shape)
        return Lazy(shape, np.dtype(np.float32), lambda: self._draw(shape, scale, lo))

    def linear(self, n_out: int, n_in: int, gain: float = 1.0) -> Lazy:
        """A torch-layout Linear weight (out, in) -> ggml ne [in, out]."""
        return self.uniform((n_out, n_in), gain * np.sqrt(3.0 / n_in))

    def conv(self, n_out: int, n_in: int, k: int, gain: float = 1.0, f16: bool = False) -> Lazy:
        """A torch Conv1d weight (OC, IC, K) -> ggml ne [K, IC, OC]."""
        w = self.uniform((n_out, n_in, k), gain * np.sqrt(3.0 / (n_in * k)))
        return w.astype(np.float16) if f16 else w

    def bias(self, n: int, scale: float = 0.02) -> Lazy:
        return self.uniform((n,), scale)


def ones(n: int) -> np.ndarray:
    return np.ones(n, dtype=np.float32)


def q8_eligible(name: str, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    """Whether llama.cpp's converter would store this tensor as Q8_0 (``--outtype q8_0``).

    As ``conversion/base.py``: 2-D+ ``.weight`` tensors, never norms or position
    tables; as ``conversion/qwen3tts.py``: conv kernels stay F16/F32 (they are
    written F16/F32 already, or have a last dim of the kernel size) and the code
    predictor's ``ffn_down`` stays F32. Q8_0 needs the row length divisible by 32.
    """
    return (dtype == np.float32 and len(shape) >= 2 and shape[-1] % Q8_BLOCK == 0
            and name.endswith(".weight") and not name.endswith("norm.weight")
            and "position_embd" not in name
            and not (name.startswith("a.gen.code.blk.") and name.endswith(".ffn_down.weight")))


def quantize_q8(a: np.ndarray) -> np.ndarray:
    """Q8_0 bytes of ``a`` (rows quantized in chunks: the same bytes, less memory)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rows = a.reshape(-1, a.shape[-1])
    step = max(1, _CHUNK // a.shape[-1])
    out = [quantize(rows[i:i + step], GGMLQuantizationType.Q8_0) for i in range(0, rows.shape[0], step)]
    return np.concatenate(out).reshape(*a.shape[:-1], -1)


class FixtureWriter:
    """A ``gguf.GGUFWriter`` front end: keys pass through, tensors are planned then streamed.

    ``q8``: store :func:`q8_eligible` tensors as Q8_0 (and the file type as
    MOSTLY_Q8_0). ``data=False``: header only, with a sparse zero data section.
    ``progress``: print a line to stderr every ~10% of the bytes.
    """

    def __init__(self, path: Path, arch: str, *, q8: bool = False, data: bool = True,
                 progress: bool = False) -> None:
        import gguf

        self._gguf = gguf
        self.path = Path(path)
        self.w = gguf.GGUFWriter(None, arch)
        self.q8, self.data, self.progress = q8, data, progress
        self.planned: list[tuple[str, np.ndarray | Lazy, bool]] = []

    def __getattr__(self, name: str):  # add_name, add_uint32, ... go to the GGUFWriter
        return getattr(self.w, name)

    def add_file_type(self, ftype: int) -> None:
        self.w.add_file_type(self._gguf.LlamaFileType.MOSTLY_Q8_0 if self.q8 else ftype)

    def add_tensor(self, name: str, value: np.ndarray | Lazy) -> None:
        quant = self.q8 and q8_eligible(name, tuple(value.shape), np.dtype(value.dtype))
        self.planned.append((name, value, quant))

    def _info(self, name: str, value, quant: bool) -> None:
        shape = tuple(value.shape)
        if quant:
            byte_shape = (*shape[:-1], shape[-1] // Q8_BLOCK * Q8_BYTES)
            self.w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)),
                                   raw_dtype=self._gguf.GGMLQuantizationType.Q8_0)
        else:
            self.w.add_tensor_info(name, shape, np.dtype(value.dtype), value.nbytes)

    def finish(self) -> Path:
        """Write the file (atomically: a temporary name, then one rename) and return its path."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for name, value, quant in self.planned:
            self._info(name, value, quant)
        total = sum(ti.nbytes for t in self.w.tensors for ti in t.values())
        with atomic_path(self.path) as tmp:
            self.w.write_header_to_file(tmp)
            self.w.write_kv_data_to_file()
            self.w.write_ti_data_to_file()
            if self.data:
                self._write_data(total)
            else:
                self._write_sparse()
            self.w.close()
        return self.path

    def _write_data(self, total: int) -> None:
        done, next_report, t0 = 0, 0.1, time.monotonic()
        for i, (name, value, quant) in enumerate(self.planned):
            arr = value.make() if isinstance(value, Lazy) else value
            if quant:
                arr = quantize_q8(arr)
            self.w.write_tensor_data(arr)
            done += arr.nbytes
            del arr
            if self.progress and total and (done / total >= next_report or i == len(self.planned) - 1):
                print(f"  {self.path.name}: {done / 2**20:.0f}/{total / 2**20:.0f} MiB, tensor {i + 1}/"
                      f"{len(self.planned)} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)
                next_report = done / total + 0.1

    def _write_sparse(self) -> None:
        fout = self.w.fout[0]
        align = self.w.data_alignment
        end = self.w.ggml_pad(fout.tell(), align)
        for ti in self.w.tensors[0].values():
            end += self.w.ggml_pad(ti.nbytes, align)
        fout.flush()
        fout.truncate(end)
