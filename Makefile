# The two commands a new machine needs: `make demo` and `make test`.
PY ?= python3
STAMP := .setup.stamp

.PHONY: setup demo test test-fast lint bench gpu-check gpu-wheels clean

# torch==2.13.0 only when no torch is importable: a user's own torch is left alone.
$(STAMP): pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m ppdsl.demo

# Two workers (pytest-xdist): the distributed tests spend much of their time
# waiting on their processes, so two keep both cores of a small machine busy.
test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 tests

# The edit-test loop: the unit tests, without the ones that start processes
# (distributed), take seconds each (slow) or need CUDA (gpu); 1.4 min on 2 cores.
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not slow and not distributed and not gpu" tests

lint: $(STAMP)
	$(PY) -m ruff check ppdsl tests bench setup.py
	$(PY) -m mypy ppdsl

bench: $(STAMP)
	$(PY) -m bench

# What the runtime does on a GPU (bench/gpu_check.py): one table, < 8 min on one
# H100/H200; without CUDA it runs what it can and names what it skipped. No setup
# step: a GPU machine has no network, so lark comes from .gpu-wheels/ (make gpu-wheels
# on a networked machine), installed with pip --no-index into .gpu-deps/.
gpu-check:
	@$(PY) -c "import lark" 2>/dev/null || ( test -n "$$(ls .gpu-wheels/*.whl 2>/dev/null)" \
		&& $(PY) -m pip install -q --no-index --target .gpu-deps .gpu-wheels/*.whl ) || true
	PYTHONPATH=$(CURDIR):$(CURDIR)/.gpu-deps$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m bench.gpu_check $(GPU_CHECK_ARGS)

gpu-wheels:
	$(PY) -m pip download -q --no-deps --only-binary :all: -d .gpu-wheels lark

clean:
	rm -rf $(STAMP) build dist *.egg-info
