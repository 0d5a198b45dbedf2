#!/usr/bin/env bash
# Build libcancelbench, the native cancel token and its readers (native/cancel_token.c)
# as a C library with a versioned ABI, into an install prefix (default
# build/libcancelbench/):
#
#   include/cancelbench/cancel_token.h   the one header (ABI version macros, the contract)
#   lib/libcancelbench.so.<major>.<minor>.0, .so.<major> (the SONAME), .so (the link name)
#   lib/libcancelbench.a                 the same objects, for static linking
#   lib/pkgconfig/cancelbench.pc         relocatable: its prefix is ${pcfiledir}/../..
#
# Use it without Python:
#   PKG_CONFIG_PATH=build/libcancelbench/lib/pkgconfig cc app.c $(pkg-config --cflags --libs cancelbench) \
#     -Wl,-rpath,"$PWD/build/libcancelbench/lib"
#
#   PREFIX   the install prefix (default <repo>/build/libcancelbench)
#   CC, AR   the C compiler and archiver (default cc, ar)
#   FORCE=1  rebuild even when the outputs are newer than their inputs
#
# The version comes from CANCELBENCH_ABI_VERSION_MAJOR/MINOR in the header.
# macOS (not run here): libcancelbench.<major>.dylib with -install_name
# @rpath/libcancelbench.<major>.dylib and -compatibility_version/-current_version,
# a libcancelbench.dylib link; the branch below does that. Idempotent.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PREFIX="${PREFIX:-$ROOT/build/libcancelbench}"
CC="${CC:-cc}"
AR="${AR:-ar}"
SRC="$ROOT/native/cancel_token.c"
HDR="$ROOT/native/cancel_token.h"

die() { echo "build_libcancelbench: $*" >&2; exit 1; }

MAJOR="$(sed -n 's/^#define CANCELBENCH_ABI_VERSION_MAJOR \([0-9][0-9]*\)$/\1/p' "$HDR")"
MINOR="$(sed -n 's/^#define CANCELBENCH_ABI_VERSION_MINOR \([0-9][0-9]*\)$/\1/p' "$HDR")"
[[ -n "$MAJOR" && -n "$MINOR" ]] || die "no CANCELBENCH_ABI_VERSION_MAJOR/MINOR in $HDR"
VERSION="$MAJOR.$MINOR.0"

if [[ "$(uname -s)" == Darwin ]]; then
  SHARED_REAL="libcancelbench.$VERSION.dylib"; SHARED_SONAME="libcancelbench.$MAJOR.dylib"; SHARED_LINK="libcancelbench.dylib"
  SHARED_FLAGS=(-dynamiclib -install_name "@rpath/$SHARED_SONAME"
                -compatibility_version "$MAJOR.$MINOR" -current_version "$VERSION")
else
  SHARED_REAL="libcancelbench.so.$VERSION"; SHARED_SONAME="libcancelbench.so.$MAJOR"; SHARED_LINK="libcancelbench.so"
  SHARED_FLAGS=(-shared "-Wl,-soname,$SHARED_SONAME" -Wl,--no-undefined)
fi

LIB="$PREFIX/lib"
OUTS=("$LIB/$SHARED_REAL" "$LIB/libcancelbench.a" "$LIB/pkgconfig/cancelbench.pc" "$PREFIX/include/cancelbench/cancel_token.h")
up_to_date() {
  [[ "${FORCE:-0}" != 1 ]] || return 1
  local o i
  for o in "${OUTS[@]}"; do
    [[ -f "$o" ]] || return 1
    for i in "$SRC" "$HDR" "${BASH_SOURCE[0]}"; do [[ "$o" -nt "$i" ]] || return 1; done
  done
  [[ -L "$LIB/$SHARED_SONAME" && -L "$LIB/$SHARED_LINK" ]]
}
if up_to_date; then
  echo "build_libcancelbench: $PREFIX is up to date (ABI $VERSION)"
  exit 0
fi

# Build into a staging prefix, then swap it in: a failed build leaves the old one.
STAGE="$PREFIX.tmp.$$"
trap 'rm -rf "$STAGE"' EXIT
rm -rf "$STAGE"
mkdir -p "$STAGE/include/cancelbench" "$STAGE/lib/pkgconfig" "$STAGE/obj"
CFLAGS_LIB=(-std=gnu11 -O2 -g -Wall -Wextra -fPIC -fvisibility=hidden)
"$CC" "${CFLAGS_LIB[@]}" -c "$SRC" -o "$STAGE/obj/cancel_token.o"
"$CC" "${SHARED_FLAGS[@]}" "$STAGE/obj/cancel_token.o" -o "$STAGE/lib/$SHARED_REAL"
ln -s "$SHARED_REAL" "$STAGE/lib/$SHARED_SONAME"
ln -s "$SHARED_SONAME" "$STAGE/lib/$SHARED_LINK"
rm -f "$STAGE/lib/libcancelbench.a"
"$AR" rcs "$STAGE/lib/libcancelbench.a" "$STAGE/obj/cancel_token.o"
cp "$HDR" "$STAGE/include/cancelbench/cancel_token.h"

# Exactly the header's functions are exported (-fvisibility=hidden + CB_EXPORT).
if command -v nm >/dev/null 2>&1 && [[ "$(uname -s)" != Darwin ]]; then
  exported="$(nm -D --defined-only "$STAGE/lib/$SHARED_REAL" | awk '$2 == "T" {print $3}' | sort)"
  declared="$(sed -n 's/^CB_EXPORT [^(]*[ *]\(cb_[a-z0-9_]*\)(.*/\1/p' "$HDR" | sort)"
  [[ "$exported" == "$declared" ]] || die "exported symbols differ from the header's CB_EXPORT declarations:
$(diff <(echo "$declared") <(echo "$exported") || true)"
fi

cat > "$STAGE/lib/pkgconfig/cancelbench.pc" <<EOF
prefix=\${pcfiledir}/../..
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: cancelbench
Description: cancelbench native cancel token and its llama.cpp/ggml readers (ABI $MAJOR.$MINOR)
Version: $VERSION
Cflags: -I\${includedir}
Libs: -L\${libdir} -lcancelbench
EOF

rm -rf "$STAGE/obj"
mkdir -p "$(dirname "$PREFIX")"
rm -rf "$PREFIX.old.$$"
[[ ! -e "$PREFIX" ]] || mv "$PREFIX" "$PREFIX.old.$$"
mv "$STAGE" "$PREFIX"
rm -rf "$PREFIX.old.$$"
trap - EXIT
echo "build_libcancelbench: built $PREFIX (ABI $VERSION, $SHARED_SONAME + libcancelbench.a)"
