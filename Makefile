# Everything runs from a virtual environment this file creates; only Python 3.11+ is needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready

.PHONY: demo test clean

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,fast,otel]'
	touch $(READY)

# `make demo PORT=8090` for another port; without PORT, the gateway's default (8080).
demo: $(READY)
	$(BIN)/ezat-gateway serve$(if $(PORT), --port $(PORT))

test: $(READY)
	$(BIN)/pytest -q -rs $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# Benchmarks (bench/README.md): `make bench BENCH_ARGS=--quick`; `make profile PROFILE=nonstream`.
PROFILE ?= stream50,nonstream
.PHONY: bench profile

bench: $(READY)
	$(BIN)/python bench/run.py $(BENCH_ARGS)

profile: $(READY)
	$(BIN)/python bench/run.py --profile $(PROFILE) $(BENCH_ARGS)
