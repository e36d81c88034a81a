#!/usr/bin/env bash
# Builds llama.cpp's llama-server for the CPU from the source vendored in the
# PyPI sdist of llama-cpp-python, and caches the binary outside the repository:
#   ${UAPPLACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/uapplace/engines}/llama.cpp-<version>/bin/llama-server
# Idempotent: a cached binary that runs is reused at once. The build happens in
# a temporary directory and lands in the cache with one rename, only on success.
#
# Usage: scripts/build-llama-server.sh [--print-path]
#   --print-path  print where the binary is (or would be) and exit 0
set -euo pipefail

# The one pin (llama-cpp-python's sdist, which vendors llama.cpp under
# vendor/llama.cpp) lives in uapplace/sim/llama-cpp.pin, which the package reads
# too (uapplace.sim.llamacpp.llama_server_path): KEY=value lines.
pin_file="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/uapplace/sim/llama-cpp.pin"
pin() {
  local value
  value="$(sed -n "s/^$1=//p" "$pin_file" 2>/dev/null | tail -n 1)"
  [ -n "$value" ] || { echo "build-llama-server: no $1= line in $pin_file" >&2; exit 1; }
  echo "$value"
}
LLAMA_CPP_PYTHON_VERSION="$(pin LLAMA_CPP_PYTHON_VERSION)"
LLAMA_CPP_PYTHON_SHA256="$(pin LLAMA_CPP_PYTHON_SHA256)"

version="$LLAMA_CPP_PYTHON_VERSION"
cache_root="${UAPPLACE_ENGINE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/uapplace/engines}"
entry="$cache_root/llama.cpp-$version"
binary="$entry/bin/llama-server"

say() { echo "build-llama-server: $*"; }
die() { echo "build-llama-server: $*" >&2; exit 1; }

case "${1:-}" in
  --print-path) echo "$binary"; exit 0 ;;
  "") ;;
  -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown argument: $1 (usage: $0 [--print-path])" ;;
esac

binary_works() { [ -x "$binary" ] && "$binary" --version >/dev/null 2>&1; }

if binary_works; then
  say "llama-server $version cached at $binary"
  echo "$binary"
  exit 0
fi

# --- from here on: a build --------------------------------------------------
step="prepare"
work=""
stage=""
log=""
build_pid=""
sleeper=""
on_exit() {
  rc=$?
  trap - INT TERM
  [ -n "$sleeper" ] && { kill "$sleeper" 2>/dev/null || true; }
  if [ -n "$build_pid" ] && kill -0 "$build_pid" 2>/dev/null; then
    kill -- "-$build_pid" 2>/dev/null || true
    wait "$build_pid" 2>/dev/null || true
  fi
  if [ "$rc" -ne 0 ]; then
    if [ -n "$log" ] && [ -s "$log" ]; then
      echo "build-llama-server: last lines of the $step log:" >&2
      tail -n 30 "$log" >&2 || true
      mkdir -p "$cache_root" 2>/dev/null && cp "$log" "$cache_root/llama.cpp-$version.failed.log" 2>/dev/null \
        && echo "build-llama-server: full log kept at $cache_root/llama.cpp-$version.failed.log" >&2
    fi
    echo "build-llama-server: FAILED at step '$step' (exit $rc); the cache was not changed" >&2
  fi
  [ -n "$stage" ] && rm -rf "$stage"
  [ -n "$work" ] && rm -rf "$work"
  exit "$rc"
}
trap on_exit EXIT
trap 'echo "build-llama-server: interrupted" >&2; exit 130' INT
trap 'echo "build-llama-server: terminated" >&2; exit 143' TERM

mkdir -p "$cache_root"

# One build at a time per version; a waiter re-checks the cache after the lock.
exec 9>"$cache_root/.llama.cpp-$version.lock"
if ! flock -n 9; then
  say "another build of $version is running; waiting for it"
  flock 9
fi
if binary_works; then
  say "llama-server $version cached at $binary"
  echo "$binary"
  exit 0
fi
if [ -e "$entry" ]; then
  say "removing a broken cache entry $entry"
  rm -rf "$entry"
fi

# --- prerequisites ----------------------------------------------------------
step="prerequisites"
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v g++ >/dev/null || missing+=(g++)
command -v gcc >/dev/null || missing+=(gcc)
if ! command -v ninja >/dev/null && ! command -v make >/dev/null; then missing+=(ninja-build); fi
python3 -m pip --version >/dev/null 2>&1 || missing+=(python3-pip)
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null; then SUDO=sudo; else
      die "not root and no sudo; install as root: apt-get install ${missing[*]}"
    fi
  else
    SUDO=""
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if command -v ninja >/dev/null; then generator="Ninja"; else generator="Unix Makefiles"; fi

work="$(mktemp -d "${TMPDIR:-/tmp}/build-llama-server.XXXXXX")"
log="$work/build.log"
: >"$log"

# --- download ---------------------------------------------------------------
step="download"
t0=$SECONDS
say "downloading llama-cpp-python==$version sdist"
python3 -m pip download --quiet --no-deps --no-binary :all: \
  "llama-cpp-python==$version" -d "$work/dl" >>"$log" 2>&1
sdist="$work/dl/llama_cpp_python-$version.tar.gz"
[ -f "$sdist" ] || { echo "no $sdist after pip download" >>"$log"; false; }
got="$(sha256sum "$sdist" | cut -d' ' -f1)"
if [ "$got" != "$LLAMA_CPP_PYTHON_SHA256" ]; then
  echo "sha256 mismatch: got $got, want $LLAMA_CPP_PYTHON_SHA256" >>"$log"
  false
fi
say "downloaded $(du -h "$sdist" | cut -f1) in $((SECONDS - t0))s"

# --- unpack -----------------------------------------------------------------
step="unpack"
t0=$SECONDS
say "unpacking vendor/llama.cpp"
tar -xzf "$sdist" -C "$work" \
  "llama_cpp_python-$version/vendor/llama.cpp" "llama_cpp_python-$version/.git" >>"$log" 2>&1 \
  || tar -xzf "$sdist" -C "$work" "llama_cpp_python-$version/vendor/llama.cpp" >>"$log" 2>&1
src="$work/llama_cpp_python-$version/vendor/llama.cpp"
[ -f "$src/tools/server/server.cpp" ] || { echo "no tools/server in $src" >>"$log"; false; }
rm -f "$sdist"
say "unpacked in $((SECONDS - t0))s"

# --- configure --------------------------------------------------------------
step="configure"
t0=$SECONDS
say "configuring ($generator, Release, CPU only, static)"
cmake -S "$src" -B "$work/build" -G "$generator" \
  -DCMAKE_BUILD_TYPE=Release \
  -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF \
  -DGGML_BLAS=OFF \
  -DGGML_OPENMP=OFF \
  -DLLAMA_CURL=OFF \
  -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF \
  >>"$log" 2>&1
say "configured in $((SECONDS - t0))s"

# --- build ------------------------------------------------------------------
step="build"
t0=$SECONDS
jobs="$(nproc)"
say "building llama-server with -j$jobs (several minutes)"
# In its own session, so that an interrupt can stop the whole compiler tree.
setsid cmake --build "$work/build" --target llama-server -j "$jobs" >>"$log" 2>&1 &
build_pid=$!
while kill -0 "$build_pid" 2>/dev/null; do
  sleep 30 &
  sleeper=$!
  wait "$sleeper" || true # `wait`, unlike a foreground sleep, lets INT/TERM in at once
  sleeper=""
  kill -0 "$build_pid" 2>/dev/null && say "building... $((SECONDS - t0))s"
done
wait "$build_pid"
build_pid=""
built="$work/build/bin/llama-server"
[ -x "$built" ] || { echo "no $built after the build" >>"$log"; false; }
"$built" --version >>"$log" 2>&1
say "built in $((SECONDS - t0))s"

# --- install ----------------------------------------------------------------
step="install"
stage="$(mktemp -d "$cache_root/.llama.cpp-$version.XXXXXX")"
mkdir -p "$stage/bin"
cp "$built" "$stage/bin/llama-server"
strip "$stage/bin/llama-server" 2>/dev/null || true
"$stage/bin/llama-server" --version >"$stage/VERSION" 2>&1
chmod 755 "$stage"
mv -T "$stage" "$entry"
stage=""
rm -f "$cache_root/llama.cpp-$version.failed.log"
say "installed $(du -h "$binary" | cut -f1) binary; $(tail -n 2 "$entry/VERSION" | tr '\n' ' ')"
say "llama-server $version cached at $binary"
echo "$binary"
