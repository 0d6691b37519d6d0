# The two commands of the kit: `make demo` and `make test`. Each does its own set-up.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

# The demo: the article's workload through the same code path, on a slice small enough for a laptop.
DEMO_ROOT := runs/demo-$(shell date -u +%Y%m%d-%H%M%S)
DEMO_SETTINGS := cluster.backend=local data.train_size=12000 data.test_size=2000 train.epochs=3 output.root=$(DEMO_ROOT)

# A Slurm source archive (SLURM_SOURCE=…/slurm-25.11.7.tar.gz, as a make or an environment
# variable): `make test` then builds that Slurm once, outside the repository
# (slurm/testcluster/build-slurm.sh), and runs the tests of a cluster on it too, after the whole
# suite on the system's Slurm. Without it, the system's Slurm alone.
SLURM_SOURCE ?=
# The tests that run on both releases: every test of a test cluster (docs/slurm-releases.md).
SLURM_TESTS := slurm or netns

.PHONY: demo install test test-slurm-source lint slurm-packages

demo: $(STAMP)
	$(PY) -m launch submit --mode dp --nodes 1 $(DEMO_SETTINGS) --wait
	$(PY) -m launch submit --mode ddp --nodes 1 $(DEMO_SETTINGS) --wait
	$(PY) -m analysis summarize $(DEMO_ROOT) --plot $(DEMO_ROOT)/comparison.png

# Set-up alone (for a cluster's login node): the .venv with the kit and its dependencies.
install: $(STAMP)
	@echo "installed: $(abspath $(PY)) (torch $$($(PY) -c 'import torch; print(torch.__version__)'))"

test: $(STAMP) slurm-packages lint
	$(PY) -m pytest -n 6 --dist loadfile --no-loadscope-reorder --durations=25
ifneq ($(strip $(SLURM_SOURCE)),)
	$(MAKE) --no-print-directory test-slurm-source
endif

# The tests of a cluster again, on the Slurm built from SLURM_SOURCE (built on first use).
test-slurm-source: $(STAMP) slurm-packages
	@test -n "$(SLURM_SOURCE)" || { echo "test-slurm-source: set SLURM_SOURCE to a Slurm source archive" >&2; exit 2; }
	prefix=$$(bash slurm/testcluster/build-slurm.sh "$(SLURM_SOURCE)") && \
		TESTCLUSTER_SLURM_PREFIX="$$prefix" $(PY) -m pytest -m "$(SLURM_TESTS)" \
		-n 4 --dist loadfile --no-loadscope-reorder --durations=10

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

slurm-packages:
	bash slurm/testcluster/install.sh

$(STAMP): pyproject.toml
	@echo "set-up: a virtual environment in $(VENV) with the kit, torch, torchvision, submitit, omegaconf, pandas (several GB the first time; pip's progress below)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --editable '.[dev]'
	touch $(STAMP)
