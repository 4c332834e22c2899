# Two commands on a fresh machine:
#   make demo   - local control plane + KubeRay + operator, apply a sample RLHFJob, watch it run
#   make test   - the whole test suite (unit, integration on a real control plane, real pods, runtime on real Ray+vLLM)
PY := .venv/bin/python

.PHONY: setup images test demo demo-down crds lint
setup:
	bash hack/setup.sh

# Container images for real nodes (operator, CPU runtime, KubeRay, pause, sandbox), cached by content hash.
images: setup
	bash hack/build-images.sh >/dev/null

# The tiers run side by side in 2 workers (tests/conftest.py says how they share them).
test: setup images
	$(PY) -m pytest -ra --durations=20 -n 2

demo: setup images
	$(PY) hack/demo.py

demo-down:
	$(PY) hack/localcluster.py down --dir /tmp/rlhf-demo

crds:
	$(PY) -m rlhf_api.crdgen --write

lint:
	$(PY) -m ruff check operator tests hack benchmarks
