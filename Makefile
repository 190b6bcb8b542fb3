# Everything runs from a virtual environment this file creates; only Python 3.11+ is needed.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
READY  := $(VENV)/.ready
# Exact versions and hashes (`make lock` writes both): everything the virtualenv installs, and the
# runtime's share of it (with uvloop and OpenTelemetry), which the container image installs.
LOCK         := requirements.lock
RUNTIME_LOCK := requirements-runtime.lock

.PHONY: demo test test-oldest lint lock clean image deploy-check image-check docs-images

# The locked packages, each checked against its hashes, then the project itself, built by the
# locked backend (hatchling is in the lock): a new lock or pyproject.toml installs again.
$(READY): $(LOCK) pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --require-hashes -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps --no-build-isolation -e .
	touch $(READY)

# `make demo PORT=8090` for another port; without PORT, the gateway's default (8080).
# `make demo PROVIDER=bedrock` (or vertex, or anthropic) answers with that provider's built-in mock.
demo: $(READY)
	$(BIN)/ezat-gateway serve$(if $(PORT), --port $(PORT))$(if $(PROVIDER), --mock-provider $(PROVIDER))

# In parallel (pytest-xdist), one worker per core of a 2-core machine: more would wait less, but
# crowd the tests that measure a deadline. `--dist loadfile` keeps each file's tests in one worker,
# and so its module-scoped fixtures, built once. `make test TEST_WORKERS=0` runs them in this one
# process; each worker has its own Redis database, counting down from EZAT_TEST_REDIS_URL's.
TEST_WORKERS ?= 2
test: $(READY)
	@echo "make test: the whole suite takes about 7 minutes on 2 cores in 2 workers, over 10 in one process (its first run installs the Node.js clients too)"
	$(BIN)/pytest -q -rs -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# docs/images/console-overview.png, docs/admin.md's picture of the console, made again from demo
# data with Debian's chromium (/usr/bin/chromium), as the console's browser test uses it.
docs-images: $(READY)
	$(BIN)/python docs/images/console_overview.py

# The stage tests on the oldest versions pyproject.toml's ranges allow, in a virtualenv of their
# own in a temporary folder (tests/test_oldest_versions.py); it downloads them from PyPI.
test-oldest: $(READY)
	$(BIN)/pip install --quiet uv==$(UV_VERSION)
	EZAT_TEST_OLDEST=1 $(BIN)/pytest -q -rs tests/test_oldest_versions.py

# ruff's lint rules and its formatter, as pyproject.toml's [tool.ruff] sets them, on the whole tree;
# then mypy on middlewares/ and gateway/, as its [tool.mypy] sets it.
lint: $(READY)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# After a change to pyproject.toml's dependencies: pins what is new and keeps every other pin.
# `make lock LOCK_ARGS=--upgrade` moves every pin to the newest release the ranges allow;
# `LOCK_ARGS="--upgrade-package aiohttp"` one package. Universal: markers where a platform or
# Python needs them, and the hash of every file of each pinned version, so the lock installs with
# any Python 3.11+ on Linux x86_64 or aarch64. [build-system] requires is locked too: `make`
# builds the project with the lock's backend, not with whatever release is newest that day.
UV_VERSION   := 0.13.9
LOCK_EXTRAS  := test fast otel lint deploy
LOCK_OPTIONS := --universal --python-version 3.11 --generate-hashes --custom-compile-command "make lock" --quiet
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv==$(UV_VERSION)
	build_requires=$$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"], sep="\n")') \
	  && printf '%s\n' "$$build_requires" | $(BIN)/uv pip compile pyproject.toml - $(addprefix --extra ,$(LOCK_EXTRAS)) \
	    $(LOCK_OPTIONS) $(LOCK_ARGS) -o $(LOCK)
	$(BIN)/uv pip compile pyproject.toml --extra fast --extra otel --constraints $(LOCK) $(LOCK_OPTIONS) -o $(RUNTIME_LOCK)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache

# The container image (deploy/Dockerfile), with podman or docker: `make image IMAGE_ARGS="--build-arg BASE=..."`.
# (podman's own OCI format has no HEALTHCHECK: the image is built in Docker's.)
CONTAINER ?= $(shell command -v podman || command -v docker)
image:
	$(CONTAINER) build $(if $(findstring podman,$(CONTAINER)),--format docker) -f deploy/Dockerfile -t ezat-gateway:local $(IMAGE_ARGS) .

# Every deployment file checked offline: the Dockerfile linted, the manifests validated (deploy/README.md).
# (hadolint and kubernetes-validate, the deploy extra, are in the lock.)
deploy-check: $(READY)
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
