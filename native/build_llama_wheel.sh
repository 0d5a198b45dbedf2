#!/usr/bin/env bash
# Build one backend variant of llama-cpp-python into its own wheelhouse.
#
#   native/build_llama_wheel.sh VARIANT        VARIANT = cpu | vulkan | metal | cuda
#
# Result: build/wheelhouse/<LLAMA_CPP_PYTHON_VERSION>-<VARIANT>/llama_cpp_python-*.whl
# Idempotent: does nothing when a wheel is already in that wheelhouse
# (set FORCE=1 to rebuild).
#
# Each variant gets its own wheelhouse because pip's wheel cache does not key on
# CMAKE_ARGS (a cached CPU wheel would otherwise be reused for Vulkan); we also
# pass --no-cache-dir so the cache is never consulted.
#
# Environment:
#   PYTHON                    python used for pip (default: .venv/bin/python)
#   LLAMA_CPP_PYTHON_VERSION  default 0.3.36
#   JOBS                      parallel compile jobs (default: nproc)
#   EXTRA_CMAKE_ARGS          appended to the variant's CMAKE_ARGS
#   FORCE=1                   rebuild even if a wheel exists
#   SKIP_APT=1                never call apt-get (vulkan: runtime packages must exist)
#
# vulkan: Debian 12's Vulkan headers (1.3.239) do not compile this llama.cpp
# (vk::LayerSettingEXT). We download Debian trixie's libvulkan-dev and
# spirv-headers with a private apt state (the system's apt lists/sources are not
# touched), extract them into build/vulkan-sdk/ and point CMake at them. The
# runtime (libvulkan1), the shader compiler (glslc) and the lavapipe driver
# (mesa-vulkan-drivers) come from the system's own suite via apt-get install.
set -euo pipefail

say() { printf '[build_llama_wheel] %s\n' "$*" >&2; }
die() { printf '[build_llama_wheel] ERROR: %s\n' "$*" >&2; exit 1; }

VARIANT="${1:-}"
case "$VARIANT" in
  cpu|vulkan|metal|cuda) ;;
  *) die "usage: $0 cpu|vulkan|metal|cuda (got '${VARIANT}')" ;;
esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PYTHON="${PYTHON:-.venv/bin/python}"
JOBS="${JOBS:-$(nproc 2>/dev/null || sysctl -n hw.ncpu 2>/dev/null || echo 2)}"
SDIST_DIR="$ROOT/build/sdist"
SDIST="$SDIST_DIR/llama_cpp_python-$VERSION.tar.gz"
WHEELHOUSE="$ROOT/build/wheelhouse/$VERSION-$VARIANT"
VK_SDK="$ROOT/build/vulkan-sdk"
# trixie packages that carry Vulkan headers new enough for this llama.cpp
VK_HEADER_SUITE="${VK_HEADER_SUITE:-trixie}"
VK_HEADER_PKGS=(libvulkan-dev spirv-headers)
# runtime + tools from the system's own Debian release
VK_RUNTIME_PKGS=(glslc libvulkan1 mesa-vulkan-drivers)

[ -x "$PYTHON" ] || command -v "$PYTHON" >/dev/null 2>&1 || die "python '$PYTHON' not found (set PYTHON=...)"

shopt -s nullglob

# ---------------------------------------------------------------- vulkan prerequisites
have_debian_apt() {
  command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1 && [ -r /etc/debian_version ]
}

apt_mirror_uri() {
  # first "URIs:" of the main (non-security) Debian deb822 source, else the
  # first deb line of a classic sources.list, else deb.debian.org
  local uri=""
  if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    uri="$(awk '/^URIs:/ { for (i = 2; i <= NF; i++) if ($i !~ /security/) { print $i; exit } }' \
             /etc/apt/sources.list.d/debian.sources)"
  fi
  if [ -z "$uri" ] && [ -r /etc/apt/sources.list ]; then
    uri="$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' \
             /etc/apt/sources.list)"
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

ensure_vulkan_runtime() {
  local missing=() p
  for p in "${VK_RUNTIME_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ "${#missing[@]}" -eq 0 ]; then
    say "vulkan runtime packages present: ${VK_RUNTIME_PKGS[*]}"
    return
  fi
  [ "${SKIP_APT:-0}" = "1" ] && die "SKIP_APT=1 but packages missing: ${missing[*]}"
  local sudo=""
  [ "$(id -u)" -ne 0 ] && sudo="sudo"
  say "installing vulkan runtime packages: ${missing[*]}"
  $sudo apt-get -o DPkg::Lock::Timeout=600 update \
    || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=600 install -y --no-install-recommends "${missing[@]}" \
    || die "apt-get install ${missing[*]} failed"
}

ensure_vulkan_headers() {
  if [ -f "$VK_SDK/usr/include/vulkan/vulkan.hpp" ] && [ -d "$VK_SDK/usr/include/spirv" ]; then
    say "vulkan headers already extracted in $VK_SDK"
    return
  fi
  local tmp mirror
  tmp="$(mktemp -d "${TMPDIR:-/tmp}/cancelbench-vk-apt.XXXXXX")"
  mirror="$(apt_mirror_uri)"
  say "fetching ${VK_HEADER_PKGS[*]} from $mirror suite $VK_HEADER_SUITE (private apt state in $tmp)"
  mkdir -p "$tmp/lists/partial" "$tmp/archives/partial" "$tmp/debs"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  local signed=""
  [ -r "$keyring" ] && signed=" [signed-by=$keyring]"
  echo "deb$signed $mirror $VK_HEADER_SUITE main" > "$tmp/sources.list"
  local aptopts=(
    -o "Dir::Etc::sourcelist=$tmp/sources.list"
    -o "Dir::Etc::sourceparts=-"
    -o "Dir::State::Lists=$tmp/lists"
    -o "Dir::Cache::archives=$tmp/archives"
    -o "Dir::Cache::pkgcache=$tmp/pkgcache.bin"
    -o "Dir::Cache::srcpkgcache=$tmp/srcpkgcache.bin"
    -o "APT::Get::List-Cleanup=0"
  )
  # the private state lives in a 0700 temp dir the _apt sandbox user cannot enter
  [ "$(id -u)" -eq 0 ] && aptopts+=(-o "APT::Sandbox::User=root")
  apt-get "${aptopts[@]}" update || die "apt-get update for $VK_HEADER_SUITE failed"
  (cd "$tmp/debs" && apt-get "${aptopts[@]}" download "${VK_HEADER_PKGS[@]}") \
    || die "apt-get download ${VK_HEADER_PKGS[*]} from $VK_HEADER_SUITE failed"
  rm -rf "$VK_SDK"
  mkdir -p "$VK_SDK"
  local deb
  for deb in "$tmp"/debs/*.deb; do
    say "extracting $(basename "$deb") -> $VK_SDK"
    dpkg -x "$deb" "$VK_SDK"
  done
  rm -rf "$tmp"
  [ -f "$VK_SDK/usr/include/vulkan/vulkan.hpp" ] || die "vulkan.hpp missing after extraction"
}

# ---------------------------------------------------------------- already built?
# The Vulkan wheel links libvulkan.so.1: make sure the runtime is there even when
# the wheel itself is cached.
if [ "$VARIANT" = vulkan ] && have_debian_apt; then
  ensure_vulkan_runtime
fi
existing=("$WHEELHOUSE"/llama_cpp_python-"$VERSION"-*.whl)
if [ "${#existing[@]}" -gt 0 ] && [ "${FORCE:-0}" != "1" ]; then
  say "wheel already present, nothing to do: ${existing[0]}"
  echo "${existing[0]}"
  exit 0
fi

# ---------------------------------------------------------------- sdist
if [ ! -f "$SDIST" ]; then
  say "sdist missing; downloading llama-cpp-python==$VERSION into $SDIST_DIR"
  mkdir -p "$SDIST_DIR"
  "$PYTHON" -m pip download --no-deps --no-binary :all: -d "$SDIST_DIR" "llama-cpp-python==$VERSION" \
    || die "pip download of llama-cpp-python==$VERSION failed"
  [ -f "$SDIST" ] || die "pip download did not produce $SDIST"
fi
say "sdist: $SDIST"

CMAKE_VARIANT_ARGS=""
case "$VARIANT" in
  cpu)
    CMAKE_VARIANT_ARGS="-DGGML_NATIVE=ON"
    ;;
  vulkan)
    if have_debian_apt; then
      ensure_vulkan_headers
    else
      say "not a Debian/apt system: skipping apt. Install the Vulkan SDK (headers >= 1.4, glslc, loader)"
      say "yourself and pass -DVulkan_INCLUDE_DIR/-DVulkan_LIBRARY via EXTRA_CMAKE_ARGS if needed."
    fi
    command -v glslc >/dev/null 2>&1 || die "glslc not found (Debian: apt-get install glslc)"
    CMAKE_VARIANT_ARGS="-DGGML_NATIVE=ON -DGGML_VULKAN=on"
    if [ -f "$VK_SDK/usr/include/vulkan/vulkan.hpp" ]; then
      CMAKE_VARIANT_ARGS+=" -DVulkan_INCLUDE_DIR=$VK_SDK/usr/include"
      # ggml-vulkan does find_package(SPIRV-Headers CONFIG REQUIRED)
      CMAKE_VARIANT_ARGS+=" -DSPIRV-Headers_DIR=$VK_SDK/usr/share/cmake/SPIRV-Headers"
      # link against the system loader (the trixie dev package's libvulkan.so
      # symlink points at a libvulkan.so.1 we did not extract)
      vk_lib="$(ls /usr/lib/*-linux-gnu/libvulkan.so.1 /usr/lib/libvulkan.so.1 2>/dev/null | head -n1 || true)"
      [ -n "$vk_lib" ] || die "libvulkan.so.1 not found (Debian: apt-get install libvulkan1)"
      CMAKE_VARIANT_ARGS+=" -DVulkan_LIBRARY=$vk_lib"
    fi
    ;;
  metal)
    [ "$(uname -s)" = "Darwin" ] || die "metal variant builds on macOS only"
    CMAKE_VARIANT_ARGS="-DGGML_METAL=on"
    ;;
  cuda)
    command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] \
      || die "cuda variant needs nvcc (CUDA toolkit) on PATH or in /usr/local/cuda/bin"
    CMAKE_VARIANT_ARGS="-DGGML_CUDA=on"
    # llama.cpp defaults CMAKE_CUDA_ARCHITECTURES to "native", which needs a visible GPU
    if [[ "${EXTRA_CMAKE_ARGS:-}" != *CMAKE_CUDA_ARCHITECTURES* ]] \
        && ! nvidia-smi -L >/dev/null 2>&1; then
      die "no NVIDIA GPU visible (nvidia-smi -L failed): set EXTRA_CMAKE_ARGS=-DCMAKE_CUDA_ARCHITECTURES=<sm, e.g. 89;90> to cross-build (also needs cuBLAS headers/libs)"
    fi
    ;;
esac

export CMAKE_ARGS="$CMAKE_VARIANT_ARGS${EXTRA_CMAKE_ARGS:+ $EXTRA_CMAKE_ARGS}"
export CMAKE_BUILD_PARALLEL_LEVEL="$JOBS"
mkdir -p "$ROOT/build/wheelhouse"
tmp_wh="$(mktemp -d "$ROOT/build/wheelhouse/.tmp-$VARIANT.XXXXXX")"
trap 'rm -rf "$tmp_wh"' EXIT

say "building llama-cpp-python==$VERSION variant=$VARIANT jobs=$JOBS"
say "CMAKE_ARGS=$CMAKE_ARGS"
start=$(date +%s)
"$PYTHON" -m pip wheel --no-deps --no-cache-dir -w "$tmp_wh" "$SDIST" \
  || die "pip wheel failed for variant $VARIANT (CMAKE_ARGS=$CMAKE_ARGS)"
built=("$tmp_wh"/llama_cpp_python-"$VERSION"-*.whl)
[ "${#built[@]}" -eq 1 ] || die "expected one wheel in $tmp_wh, found ${#built[@]}"
# move into place only once complete, so an interrupted build is never "present"
mkdir -p "$WHEELHOUSE"
rm -f "$WHEELHOUSE"/llama_cpp_python-"$VERSION"-*.whl
mv "${built[0]}" "$WHEELHOUSE/"
end=$(date +%s)
out="$WHEELHOUSE/$(basename "${built[0]}")"
say "built $out in $((end - start)) s"
echo "$out"
