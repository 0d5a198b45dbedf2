#!/usr/bin/env bash
# Build the C protocol engine (native/sut_text_engine.c) into
# build/sut/cancelbench-text-engine, linked against the libllama.so (and its
# ggml libraries) of the installed llama-cpp-python wheel, with an rpath to
# that directory, and against libcancelbench (its cancel token, abort and eval
# readers: native/build_libcancelbench.sh, built here first if needed) through
# pkg-config, with an rpath to build/libcancelbench/lib. libggml-base is linked
# directly: graph_eval's calibration builds real (unallocated) ggml tensors
# (ggml_init, ggml_mul_mat, ggml_flash_attn_ext, ...) for the eval reader.
#
#   PYTHON   the interpreter whose llama_cpp package is used (default .venv/bin/python)
#   CC       the C compiler (default cc)
#   FORCE=1  rebuild even when the binary is newer than its inputs
#
# Headers: the wheel ships no llama.h, so llama.h and ggml's headers are taken
# from the llama-cpp-python sdist (build/sdist/llama_cpp_python-<version>.tar.gz,
# the one the wheel was built from; downloaded with pip if missing) into
# build/sut/include/<version>/.
# Needs cJSON (Debian: libcjson-dev). Idempotent.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
CC="${CC:-cc}"
SRC="$ROOT/native/sut_text_engine.c"
OUT_DIR="$ROOT/build/sut"
OUT="$OUT_DIR/cancelbench-text-engine"

die() { echo "build_sut_engine: $*" >&2; exit 1; }

[[ -x "$PYTHON" ]] || die "no Python at $PYTHON (set PYTHON, or run make setup)"
# Locate the package without importing it (importing loads the libraries).
read -r PKG_DIR LLAMA_VERSION < <("$PYTHON" - <<'EOF'
import importlib.metadata as md, importlib.util, sys
spec = importlib.util.find_spec("llama_cpp")
if spec is None or not spec.submodule_search_locations:
    sys.exit("llama_cpp is not installed")
print(list(spec.submodule_search_locations)[0], md.version("llama_cpp_python"))
EOF
) || die "cannot locate the llama_cpp package with $PYTHON"
LIB_DIR="$PKG_DIR/lib"
[[ -f "$LIB_DIR/libllama.so" ]] || die "no libllama.so in $LIB_DIR"

# Headers: the wheel's own if it ever ships them, else the sdist's.
INC_DIR=""
for cand in "$PKG_DIR/include" "$LIB_DIR/../include"; do
  if [[ -f "$cand/llama.h" && -f "$cand/ggml-backend.h" ]]; then INC_DIR="$(cd "$cand" && pwd)"; break; fi
done
if [[ -z "$INC_DIR" ]]; then
  SDIST="$ROOT/build/sdist/llama_cpp_python-$LLAMA_VERSION.tar.gz"
  INC_DIR="$OUT_DIR/include/$LLAMA_VERSION"
  if [[ ! -f "$INC_DIR/llama.h" || ! -f "$INC_DIR/ggml-backend.h" ]]; then
    if [[ ! -f "$SDIST" ]]; then  # a cached wheel without its sdist: fetch it as build_llama_wheel.sh does
      echo "build_sut_engine: no sdist at $SDIST; downloading llama-cpp-python==$LLAMA_VERSION" >&2
      mkdir -p "$(dirname "$SDIST")"
      "$PYTHON" -m pip download -q --no-deps --no-binary :all: -d "$(dirname "$SDIST")" \
        "llama-cpp-python==$LLAMA_VERSION" || die "the wheel has no llama.h and the sdist could not be downloaded"
      [[ -f "$SDIST" ]] || die "pip download did not produce $SDIST"
    fi
    rm -rf "$INC_DIR.tmp" && mkdir -p "$INC_DIR.tmp"
    tar -xzf "$SDIST" -C "$INC_DIR.tmp" --strip-components=4 --wildcards '*/vendor/llama.cpp/include/llama.h'
    tar -xzf "$SDIST" -C "$INC_DIR.tmp" --strip-components=5 --wildcards '*/vendor/llama.cpp/ggml/include/*.h'
    rm -rf "$INC_DIR" && mv "$INC_DIR.tmp" "$INC_DIR"
  fi
fi

CJSON_CFLAGS="$(pkg-config --cflags libcjson 2>/dev/null || true)"
CJSON_LIBS="$(pkg-config --libs libcjson 2>/dev/null || echo -lcjson)"
[[ -f /usr/include/cjson/cJSON.h || -n "$CJSON_CFLAGS" ]] || die "cJSON headers not found (apt-get install libcjson-dev)"

# libcancelbench (idempotent: a no-op when it is up to date).
CB_PREFIX="$ROOT/build/libcancelbench"
bash "$ROOT/native/build_libcancelbench.sh" >&2 || die "libcancelbench did not build"
command -v pkg-config >/dev/null 2>&1 || die "pkg-config not found (apt-get install pkg-config)"
CB_PC="$CB_PREFIX/lib/pkgconfig"
CB_CFLAGS="$(PKG_CONFIG_PATH="$CB_PC" pkg-config --cflags cancelbench)" || die "pkg-config cannot read $CB_PC/cancelbench.pc"
CB_LIBS="$(PKG_CONFIG_PATH="$CB_PC" pkg-config --libs cancelbench)"

# Up to date: newer than the source, this script and the libraries it links.
if [[ "${FORCE:-0}" != 1 && -x "$OUT" && "$OUT" -nt "$SRC" && "$OUT" -nt "${BASH_SOURCE[0]}" \
      && "$OUT" -nt "$LIB_DIR/libllama.so" && "$OUT" -nt "$CB_PC/cancelbench.pc" ]]; then
  echo "build_sut_engine: $OUT is up to date"
  exit 0
fi

mkdir -p "$OUT_DIR"
TMP="$OUT.tmp.$$"
trap 'rm -f "$TMP"' EXIT
# shellcheck disable=SC2086
"$CC" -std=c11 -O2 -g -Wall -Wextra -Wno-unused-parameter -pthread \
  -I"$INC_DIR" $CB_CFLAGS $CJSON_CFLAGS \
  -DSUT_LLAMA_CPP_PYTHON_VERSION="\"$LLAMA_VERSION\"" -DSUT_LLAMA_LIB_DIR="\"$LIB_DIR\"" \
  "$SRC" -o "$TMP" \
  $CB_LIBS -Wl,-rpath,"$CB_PREFIX/lib" \
  -L"$LIB_DIR" -Wl,-rpath,"$LIB_DIR" -lllama -lggml -lggml-base $CJSON_LIBS -lm
mv -f "$TMP" "$OUT"
trap - EXIT
echo "build_sut_engine: built $OUT (llama-cpp-python $LLAMA_VERSION, $LIB_DIR; libcancelbench $CB_PREFIX/lib)"
