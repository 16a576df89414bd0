# The two commands a new machine needs: `make demo` and `make test`.
PY ?= python3
STAMP := .setup.stamp

.PHONY: setup demo test lint bench clean

# torch==2.13.0 only when no torch is importable: a user's own torch is left alone.
$(STAMP): pyproject.toml
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m ppdsl.demo

test: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests

lint: $(STAMP)
	$(PY) -m ruff check ppdsl tests bench setup.py
	$(PY) -m mypy ppdsl

bench: $(STAMP)
	$(PY) -m bench

clean:
	rm -rf $(STAMP) build dist *.egg-info
