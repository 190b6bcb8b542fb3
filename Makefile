# Everything runs from a virtual environment this file creates; only Python 3.11+ is needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready

.PHONY: demo test lint clean image deploy-check image-check

$(READY): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test,fast,lint]'
	touch $(READY)

# `make demo PORT=8090` for another port; without PORT, the gateway's default (8080).
demo: $(READY)
	$(BIN)/ezat-gateway serve$(if $(PORT), --port $(PORT))

test: $(READY)
	$(BIN)/pytest -q -rs $(PYTEST_ARGS)

# ruff's lint rules and its formatter, as pyproject.toml's [tool.ruff] sets them, on the whole tree.
lint: $(READY)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# The container image (deploy/Dockerfile), with podman or docker: `make image IMAGE_ARGS="--build-arg BASE=..."`.
# (podman's own OCI format has no HEALTHCHECK: the image is built in Docker's.)
CONTAINER ?= $(shell command -v podman || command -v docker)
image:
	$(CONTAINER) build $(if $(findstring podman,$(CONTAINER)),--format docker) -f deploy/Dockerfile -t ezat-gateway:local $(IMAGE_ARGS) .

# Every deployment file checked offline: the Dockerfile linted, the manifests validated (deploy/README.md).
DEPLOY_TOOLS := $(VENV)/.deploy-tools
$(DEPLOY_TOOLS): $(READY)
	$(BIN)/pip install --quiet -e '.[test,fast,deploy]'
	touch $(DEPLOY_TOOLS)

deploy-check: $(DEPLOY_TOOLS)
	$(BIN)/python deploy/check_manifests.py

# The image built with podman and proven by running it (deploy/check_image.py).
image-check: $(READY)
	$(BIN)/python deploy/check_image.py

# Benchmarks (bench/README.md): `make bench BENCH_ARGS=--quick`; `make profile PROFILE=nonstream`.
PROFILE ?= stream50,nonstream
.PHONY: bench profile

bench: $(READY)
	$(BIN)/python bench/run.py $(BENCH_ARGS)

profile: $(READY)
	$(BIN)/python bench/run.py --profile $(PROFILE) $(BENCH_ARGS)
