#!/usr/bin/env bash
# The device call behind benchmarks/results/cuda_h200.json (one NVIDIA H200 lent through the
# workplace's device tool): build llama-cpp-python 0.3.36 for CUDA (sm_90), install it, put
# cancelbench on PYTHONPATH, generate the field-scale models, run
# benchmarks/bench_graph_eval.py --device cuda:0 (text, then --device-speech stt,tts).
# It ran from an ignored folder .devcheck/ at the repository root holding: this script as
# run.sh, a copy of bench_graph_eval.py, the llama-cpp-python sdist repacked without .git,
# vendor/llama.cpp/{models,docs,tests,benches,media,examples,pocs,gguf-py,conversion,tools/ui,
# app,skills,ci} and the package's docs/examples/tests (8 MB), and whl/ with the gguf 0.19.0
# and diskcache 5.6.3 wheels. benchmarks/device/cuda_h200_combine.py folds the returned files
# into the results JSON. Idempotent on a warm machine (wheel, build dir and models in /tmp).
#   LIMIT   seconds this script may use in all (default 560)
#   SPEECH  1: also generate the field TTS/ASR sets and run the speech part
set -u -o pipefail
T0=$(date +%s)
LIMIT=${LIMIT:-560}
SPEECH=${SPEECH:-1}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
OUTD=${OUT:-/tmp/cbout}
mkdir -p "$OUTD"
W=/tmp/cbw
L=$W/log   # small logs: tarred into $OUT/logs.tgz at exit (at most 8 files come back)
mkdir -p "$W" "$L"
finish() {
  cp "$OUTD/steps.log" "$L/" 2>/dev/null
  tar czf "$OUTD/logs.tgz" -C "$W" log 2>/dev/null
  # no text result: bring the wheel back (parts under 16 MB) for a later call
  if [ ! -s "$OUTD/bench_text.json" ] && ls "$W"/wh/llama_cpp_python-*.whl >/dev/null 2>&1; then
    f=$(ls "$W"/wh/llama_cpp_python-*.whl | head -1)
    [ "$(stat -c %s "$f")" -lt 45000000 ] && split -b 15000000 -d "$f" "$OUTD/wheel.part" && echo "wheel parts: $(basename "$f")"
  fi
}
trap finish EXIT
export CANCELBENCH_MODELS_DIR=/tmp/cbmodels
export PYTHONUNBUFFERED=1
export PATH=/usr/local/cuda/bin:$PATH
export LD_LIBRARY_PATH=/usr/local/cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
PY=${PY:-python3}
el() { echo $(( $(date +%s) - T0 )); }
left() { echo $(( LIMIT - $(el) )); }
step() { echo "[step $(el)s $(date +%T)] $*" | tee -a "$OUTD/steps.log"; }

step "start on $(hostname) nproc=$(nproc)"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv 2>&1
  which nvcc; nvcc --version 2>&1 | tail -2
  $PY -V; cmake --version | head -1; ninja --version
  $PY -m pip list 2>/dev/null | grep -iE "^(numpy|scikit-build-core|setuptools|pyyaml|tqdm|jinja2|typing.extensions|pathspec) "
} > "$L/machine.txt" 2>&1
cat "$L/machine.txt"

step "python deps (gguf, diskcache) + cancelbench on PYTHONPATH"
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .devcheck/whl/*.whl || exit 3
export PYTHONPATH=/tmp/site
# cancelbench as pyproject maps it (cancelbench.<folder>), without installing (an old setuptools
# rejects pyproject's license string): links in this throwaway copy's cancelbench/ folder.
# The native token compiles into XDG_CACHE_HOME on first import.
for d in orchestrator device_agents native datasets reports; do [ -e "cancelbench/$d" ] || ln -s "../$d" "cancelbench/$d"; done
export PYTHONPATH=$ROOT:/tmp/site XDG_CACHE_HOME=/tmp/cbcache
$PY -c "from cancelbench import native; print('native ok', native.DEFAULT_GRAPH_SLICE_US)" || exit 5

step "model generation in the background"
gen() {  # set name -> log
  [ -f "$W/gen_$1.done" ] && return 0
  ( nice -n 5 $PY -c "from cancelbench.datasets import field; field.ensure_set('$1', verify=False, progress=True)" \
      > "$L/gen_$1.log" 2>&1 && touch "$W/gen_$1.done" ) &
  echo $! > "$W/gen_$1.pid"
}
alive() { [ -f "$W/gen_$1.pid" ] && kill -0 "$(cat "$W/gen_$1.pid")" 2>/dev/null; }
gen text-qwen3-0.6b-field   # the speech sets start after the build (fewer cores taken from it)
if ! command -v nvcc >/dev/null 2>&1; then
  for d in /usr/local/cuda*/bin; do [ -x "$d/nvcc" ] && export PATH="$d:$PATH" && break; done
fi
echo "nvcc: $(command -v nvcc)"

CMAKE_FLAGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DGGML_NATIVE=OFF -DGGML_CUDA_FA=OFF -DGGML_CUDA_NCCL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
echo "$CMAKE_FLAGS" > "$L/cmake_args.txt"
if ls .devcheck/wh/llama_cpp_python-*.whl >/dev/null 2>&1 && ! ls "$W"/wh/llama_cpp_python-*.whl >/dev/null 2>&1; then
  step "using the carried wheel $(ls .devcheck/wh/)"; mkdir -p "$W/wh"; cp .devcheck/wh/llama_cpp_python-*.whl "$W/wh/"
fi
if ! ls "$W"/wh/llama_cpp_python-*.whl >/dev/null 2>&1; then
  step "build llama-cpp-python CUDA wheel: $CMAKE_FLAGS"
  if [ ! -d "$W/src" ]; then
    mkdir -p "$W/x" && tar xzf .devcheck/llama_cpp_python-0.3.36.tar.gz -C "$W/x" && mv "$W/x/llama_cpp_python-0.3.36" "$W/src"
  fi
  tb=$(date +%s)
  CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=16 SKBUILD_BUILD_DIR="$W/build" \
    timeout $(( $(left) - 15 )) $PY -m pip wheel -v --no-build-isolation --no-deps --no-cache-dir -w "$W/wh" "$W/src" \
    > "$OUTD/build.log" 2>&1
  rc=$?
  echo "build rc=$rc in $(( $(date +%s) - tb )) s" | tee -a "$OUTD/steps.log"
  grep -E "error|Error" "$OUTD/build.log" | grep -v "Werror\|error_\|_error\|errors=" | head -20
  tail -15 "$OUTD/build.log"
  [ $rc -eq 0 ] || { step "build failed/unfinished"; exit 6; }
fi
if [ "$SPEECH" = 1 ]; then gen qwen3asr-0.6b-field; gen qwen3tts-0.6b-field; fi
step "install wheel"
$PY -m pip install -q --no-index --no-deps --force-reinstall "$W"/wh/llama_cpp_python-*.whl || exit 7
ls -la "$W"/wh/
$PY - <<'EOF' 2>&1 | tee "$L/llama_check.txt"
import llama_cpp
print("llama_cpp", llama_cpp.__version__, "gpu offload:", llama_cpp.llama_supports_gpu_offload())
from cancelbench.device_agents import backends
print(backends.llama_cpp_build_info())
EOF

step "wait for the text model"
while [ ! -f "$W/gen_text-qwen3-0.6b-field.done" ] && [ "$(left)" -gt 60 ]; do
  alive text-qwen3-0.6b-field || break
  sleep 2
done
tail -3 "$L/gen_text-qwen3-0.6b-field.log"
ls -la /tmp/cbmodels/ 2>/dev/null

step "bench text on cuda:0 ($(left) s left)"
timeout $(( $(left) - 10 )) $PY .devcheck/bench_graph_eval.py --device "${DEVICE:-cuda:0}" --model "${MODEL:-text-qwen3-0.6b-field}" \
  --prompt-tokens "${PROMPT_TOKENS:-4000}" --device-trials "${TRIALS:-20}" --device-threads 4 \
  --out "$OUTD/bench_text.json" 2>&1 | tee "$L/bench_text.log"
step "bench text rc=$?"

if [ "$SPEECH" = 1 ] && [ "$(left)" -gt 60 ]; then
  step "wait for the speech models ($(left) s left)"
  while { [ ! -f "$W/gen_qwen3asr-0.6b-field.done" ] || [ ! -f "$W/gen_qwen3tts-0.6b-field.done" ]; } \
        && [ "$(left)" -gt 50 ] && { alive qwen3asr-0.6b-field || alive qwen3tts-0.6b-field; }; do sleep 2; done
  sp=""
  [ -f "$W/gen_qwen3asr-0.6b-field.done" ] && sp="stt"
  [ -f "$W/gen_qwen3tts-0.6b-field.done" ] && sp="${sp:+$sp,}tts"
  if [ -n "$sp" ] && [ "$(left)" -gt 40 ]; then
    step "bench speech $sp on cuda:0 ($(left) s left)"
    timeout $(( $(left) - 8 )) $PY .devcheck/bench_graph_eval.py --device "${DEVICE:-cuda:0}" --skip text --device-speech "$sp" \
      --device-trials "${SPEECH_TRIALS:-6}" --device-threads 4 --out "$OUTD/bench_speech.json" 2>&1 \
      | tee "$L/bench_speech.log" | tail -40
    step "bench speech rc=$?"
  fi
fi
step "done"
