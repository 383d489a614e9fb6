# Two environments:
#   .venv                  the package alone (grpc, protobuf, tenacity): enough for `make demo`
#   $(TEST_VENV)           + test tools + torch 2.9.0 + torch_xla 2.9.0 + jax (about 8 GB, 3-5 min the
#                          first time); kept in ~/.cache keyed by pyproject.toml so CI reuses it
PYTHON ?= python3
DEPS_HASH := $(shell cat pyproject.toml .ci/requirements-test.txt | sha256sum | cut -c1-12)
CACHE ?= $(HOME)/.cache/pjrt-rendezvous
TEST_VENV ?= $(CACHE)/test-venv-$(DEPS_HASH)

.PHONY: demo test test-fast protos clean print-venv

# setuptools' notes on this layout, about 70 lines at every editable install: its experimental
# [tool.setuptools.ext-modules], an editable install's package-dir mapping, and the .proto
# folder that holds a development script on purpose (protos/pjrt_rendezvous/generate.py).
QUIET_BUILD := PYTHONWARNINGS=ignore::UserWarning

.venv/.installed: pyproject.toml
	$(PYTHON) -m venv .venv
	.venv/bin/pip install -q --upgrade pip
	$(QUIET_BUILD) .venv/bin/pip install -q -e .
	touch $@

## demo: run a coordinator and a simulated TPU v3-8 (4 processes x 2 threads) on this machine
demo: .venv/.installed
	.venv/bin/pjrt-rendezvous demo

# No prerequisites: the hash in the folder name already covers their content, and a fresh
# clone's new file times must not force a rebuild.
$(TEST_VENV)/.installed:
	rm -rf $(TEST_VENV)
	@# older environments of this project (other dependency hashes) only take disk space
	rm -rf $(filter-out $(TEST_VENV),$(wildcard $(CACHE)/test-venv-*))
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q -r .ci/requirements-test.txt
	touch $@

## test: the whole suite (unit, property, integration with real processes, torch and torch_xla)
test: $(TEST_VENV)/.installed
	@# re-point the editable install at this checkout (CI clones to a new folder each run)
	$(QUIET_BUILD) $(TEST_VENV)/bin/pip install -q --no-deps --no-build-isolation -e .
	$(TEST_VENV)/bin/python -m pytest $(PYTEST_ARGS)

## test-fast: everything except the torch_xla tests
test-fast: PYTEST_ARGS = -m "not xla"
test-fast: test

## protos: regenerate protos/v1 from protos/pjrt_rendezvous/v1/*.proto
protos: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python protos/pjrt_rendezvous/generate.py

clean:
	rm -rf .venv build *.egg-info .pytest_cache .hypothesis

print-venv:
	@echo $(TEST_VENV)
