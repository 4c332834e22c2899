# Two commands on a fresh machine:
#   make demo   - local control plane + KubeRay + operator, apply a sample RLHFJob, watch it run
#   make test   - the whole test suite (unit, integration on a real control plane, runtime on real Ray+vLLM)
PY := .venv/bin/python

.PHONY: setup test demo demo-down crds lint
setup:
	bash hack/setup.sh

test: setup
	$(PY) -m pytest -ra --durations=15

demo: setup
	$(PY) hack/demo.py

demo-down:
	$(PY) hack/localcluster.py down --dir /tmp/rlhf-demo

crds:
	$(PY) -m rlhf_api.crdgen --write

lint:
	$(PY) -m ruff check operator tests hack benchmarks
