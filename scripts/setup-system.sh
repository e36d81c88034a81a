#!/usr/bin/env bash
# Installs the Debian packages uapplace needs to build, run and test; idempotent.
# Only what is missing is installed; nothing is done when everything is present.
set -euo pipefail

packages=(
  # build pystemd and dbus-python
  libsystemd-dev pkg-config libdbus-1-dev libglib2.0-dev
  # build PyGObject (python-dbusmock's templates import gi)
  libgirepository1.0-dev libcairo2-dev gir1.2-glib-2.0
  # runtime: the bus, the user manager, busctl
  dbus-daemon systemd
  # tests: xmllint for the polkit policy, ip for the veth peer test, tmux for the
  # real-terminal test of `uapplace top` (tests/systemd/test_top_tmux.py)
  libxml2-utils iproute2 tmux
  # a compiler for the extensions
  gcc python3-dev
  # build llama.cpp's llama-server (make engine: scripts/build-llama-server.sh, which
  # fetches its source with pip and builds it with CMake and Ninja)
  cmake g++ ninja-build python3-pip
  # promtool (the unit tests of contrib/prometheus/'s rules) and a real prometheus
  # server (the systemd tier scrapes the demo's shim with it)
  prometheus
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "setup-system: all system packages present"
  exit 0
fi

echo "setup-system: installing ${missing[*]}"
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then SUDO=sudo; else
    echo "setup-system: not root and no sudo; install as root: apt-get install ${missing[*]}" >&2
    exit 1
  fi
else
  SUDO=""
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
