#!/usr/bin/env bash
# Make sure a Vulkan device exists for ManiSkill/SAPIEN (it needs one even for state observations).
# With no GPU, SAPIEN needs Mesa's software renderer (lavapipe) >= 24.3; Debian bookworm ships 22.3,
# bookworm-backports ships 25.x. Installs only when no working device is found.
#   usage: launch/setup_vulkan.sh PYTHON
set -euo pipefail
PY=${1:-python3}

probe() { "$PY" -c "import sapien; sapien.render.SapienRenderer()" >/dev/null 2>&1; }

if probe; then
  echo "vulkan: a working device is present"
  exit 0
fi

echo "vulkan: no working Vulkan device for SAPIEN; installing Mesa's software renderer from bookworm-backports"
if [ "$(id -u)" != "0" ]; then
  echo "vulkan: not root. Ask an administrator to run, once:" >&2
  echo "  echo 'deb http://deb.debian.org/debian bookworm-backports main' > /etc/apt/sources.list.d/backports.list" >&2
  echo "  apt-get update && apt-get install -y -t bookworm-backports mesa-vulkan-drivers libvulkan1" >&2
  echo "  (or install a GPU driver with Vulkan support), then run make setup again." >&2
  exit 1
fi
codename=$(. /etc/os-release 2>/dev/null && echo "${VERSION_CODENAME:-}")
if [ "$codename" != "bookworm" ]; then
  echo "vulkan: this is not Debian bookworm ('${codename:-unknown}'). Install Mesa >= 24.3 Vulkan drivers" >&2
  echo "  (lavapipe: package mesa-vulkan-drivers) and libvulkan1 with your package manager, then run make setup again." >&2
  exit 1
fi

# Reuse the mirror the system already uses.
mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
         | grep -v security | head -n1 | awk '{print $2}' || true)
mirror=${mirror:-http://deb.debian.org/debian}
echo "deb ${mirror%/} bookworm-backports main" > /etc/apt/sources.list.d/asyncvla-backports.list
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null

if probe; then
  echo "vulkan: software renderer installed and working"
else
  echo "vulkan: installed Mesa from bookworm-backports but SAPIEN still finds no device:" >&2
  "$PY" -c "import sapien; sapien.render.SapienRenderer()" >&2 || true
  exit 1
fi
