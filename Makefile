# Two commands do all the set-up on a fresh machine with Python:
#   make demo   creates .venv, installs torch then this package, runs the main job
#   make test   same set-up, then the test suite
PYTHON ?= python3
# torch is installed first, pinned (a later unpinned torch would be the newest CUDA build). pip
# takes a local CPU wheel of this version where one is configured (this project's CI machines);
# elsewhere on Linux, PyPI's torch==2.13.0 is the CUDA build (about 2.7 GB; it runs on CPU too).
# A CPU-only torch from PyTorch's CPU wheel index:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
VENV ?= .venv
PY := $(VENV)/bin/python
WORK ?= work

.PHONY: demo demo-reverse test test-gpu install clean FORCE

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch again whenever TORCH or TORCH_INDEX differ from the last install
$(VENV)/.torch: $(PY) FORCE
	@if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH) $(TORCH_INDEX)" ]; then \
	  echo "$(PY) -m pip install \"$(TORCH)\" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))"; \
	  ! $(PY) -m pip show -q torch 2>/dev/null || $(PY) -m pip uninstall -y -q torch; \
	  $(PY) -m pip install "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) && \
	  echo "$(TORCH) $(TORCH_INDEX)" > $@; fi

$(VENV)/.deps: setup.py $(VENV)/.torch
	$(PY) -m pip install ".[test]"
	touch $@

# (re)install the package itself whenever its code changes, so --user-dir fairseq_plugin works
$(VENV)/.installed: $(VENV)/.deps $(shell find fairseq_plugin -name '*.py')
	$(PY) -m pip install --no-deps --force-reinstall --quiet .
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) scripts/translation_demo.py --work-dir $(WORK)/tatoeba

demo-reverse: install
	$(PY) scripts/reverse_demo.py --work-dir $(WORK)/reverse

test: install
	$(PY) -m pytest -q tests

# the tests whose behaviour depends on the device, on a CUDA GPU (skipped, with the reason, without)
test-gpu: install
	$(PY) -m pytest -q -m cuda -rs tests

clean:
	rm -rf $(VENV) $(WORK) build *.egg-info

FORCE:
