#!/usr/bin/env bash
# The MLflow tracking server the tests run against (tests/helpers.py MLflowServer): MLflow's own server from PyPI
# in a venv of its own (its server dependencies - Flask, SQLAlchemy, pandas, scikit-learn, ... - stay out of the
# project's venv), cached under ~/.cache/rlhf-operator. Idempotent; prints the `mlflow` command's path.
set -euo pipefail
VERSION=3.17.2
PY="${PYTHON:-python3}"
dir="${RLHF_CACHE:-$HOME/.cache/rlhf-operator}/mlflow-$VERSION"
if [ ! -f "$dir/.complete" ]; then
  rm -rf "$dir"
  "$PY" -m venv "$dir"
  "$dir/bin/python" -m pip install -q "mlflow==$VERSION" >&2
  touch "$dir/.complete"
fi
echo "$dir/bin/mlflow"
