#!/usr/bin/env bash
# Async vs sync on one GPU node, in one call: tests/benchmarks/async_sync.py on
# configs/maniskill_gpu.yaml (SmolVLM-256M's shape, LoRA r32, bf16 ZeRO-3 learner, CPU physics with
# GPU rendering), the sync arm then the async arm, each for --time-s of training (default 140 s;
# both arms with start-up and shut-down take about 7 minutes).
#
#   bash tests/benchmarks/gpu_node.sh [OUT_DIR] [--dry-run | async_sync flags...]
#
# Run it from the repository root on a machine with a GPU and python3 holding CUDA torch. For a
# machine without internet, carry beside the repository what its image lacks (docs/benchmarks.md):
#   .whl/  wheels for python3's version of what `import asyncvla` needs and the image lacks
#          (deepspeed, pyzmq, mani_skill, sapien, omegaconf, ... at constraints.txt's versions);
#          installed with --no-deps into /tmp/site
#   .gl/   Debian packages of the Vulkan/EGL loaders (libvulkan1 libegl1 libglvnd0 ...), unpacked
#          into / when `ldconfig -p` lists no libvulkan
# It writes OUT_DIR/async_sync_gpu.json (the benchmark's JSON) and OUT_DIR/gpu.txt (the machine).
# --dry-run checks the config and prints both arms' commands on any machine, GPU or not.
set -euo pipefail
OUT_DIR=${1:-bench_results}
shift || true
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}

if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! ldconfig -p 2>/dev/null | grep -q libvulkan && compgen -G ".gl/*.deb" >/dev/null; then
  for f in .gl/*.deb; do dpkg -x "$f" /; done
  ldconfig
fi
# `import asyncvla` without installing the package: the repository root is the package.
if ! "$PY" -c "import asyncvla" 2>/dev/null; then
  mkdir -p /tmp/asyncvla-src && ln -sfn "$PWD" /tmp/asyncvla-src/asyncvla
  export PYTHONPATH=/tmp/asyncvla-src:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
fi
nproc | sed 's/^/cores: /' | tee -a "$OUT_DIR/gpu.txt"
exec "$PY" -m tests.benchmarks.async_sync --config configs/maniskill_gpu.yaml --device cuda \
  --out "$OUT_DIR/async_sync_gpu.json" "$@"
