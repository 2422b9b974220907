# Two commands do all the set-up on a fresh machine with Python:
#   make demo   creates .venv, installs torch then this package, runs the main job
#   make test   same set-up, then the test suite
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
WORK ?= work

.PHONY: demo demo-reverse test test-gpu install clean

$(VENV)/.deps: setup.py
	$(PYTHON) -m venv $(VENV)
	# torch first: a pinned CPU build; an unpinned torch pulls a multi-GB CUDA build
	$(PY) -m pip install "$(TORCH)"
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
