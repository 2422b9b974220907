# Two commands do all the set-up on a fresh machine with Python:
#   make demo   creates .venv, installs torch then this package, runs the main job
#   make test   same set-up, then the test suite; then the same on Python 3.10 with the official
#               fairseq 0.12.2 (.venv310) where pyenv or PATH has a python3.10 (required with CI=true)
PYTHON ?= python3
# torch is installed first, pinned (a later unpinned torch would be the newest CUDA build). pip
# takes a local CPU wheel of this version where one is configured (this project's CI machines);
# elsewhere on Linux, PyPI's torch==2.13.0 is the CUDA build (about 2.7 GB; it runs on CPU too).
# A CPU-only torch from PyTorch's CPU wheel index:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
PIP ?= pip
# the package's extras installed with it: the tests', and the page's (make page, its browser test)
EXTRAS ?= test,page
VENV ?= .venv
PY := $(VENV)/bin/python
# the demos' outputs (make demo WORK=dir); not taken from the environment, where HPC sites set
# $WORK to a whole filesystem (make clean-work deletes it)
WORK = work

# The second test lane: the official fairseq 0.12.2 (what most fairseq users have) on Python 3.10
# with the lowest torch setup.py admits. fairseq 0.12.2 installs only with pip < 24.1 (pip >= 24.1
# rejects omegaconf 2.0.6's metadata); torch < 2.3 needs NumPy 1; torchaudio is pinned with torch
# because fairseq 0.12.2 requires it and its newest release would pull a newer torch. PyPI has
# only CUDA builds of torch for Python 3.10 (torch 2.1.2 and its CUDA libraries: about 2.5 GB).
# the first python3.10 that runs (a pyenv shim of a version not selected does not)
PYTHON310 ?= $(shell for p in $(HOME)/.pyenv/versions/3.10*/bin/python3.10 python3.10; do \
                       "$$p" -c "" 2>/dev/null && { command -v "$$p"; break; }; done)
VENV310 ?= .venv310
TORCH310 ?= torch==2.1.2 torchaudio==2.1.2 numpy<2
LANE310 = VENV=$(VENV310) PYTHON=$(PYTHON310) TORCH="$(TORCH310)" TORCH_INDEX= PIP="pip<24.1" \
          EXTRAS=test
# the suite on two pytest-xdist workers of one thread each (files whole, those that share a
# trained model together: tests/conftest.py). They take the files in this order: the two that
# use the reverse task's model first (its training starts at once), then the longest (the walkthrough
# runs in the main lane only), then the rest, short ones to fill the end. On 2 cores both lanes'
# tests took 22 to 25 minutes so (15-17.5 + 7).
TEST_WORKERS ?= 2
PYTEST = OMP_NUM_THREADS=1 $(1)/bin/python -m pytest -q -rs --durations=40 -n $(TEST_WORKERS) --no-loadscope-reorder
TESTS_WALKTHROUGH = tests/test_walkthrough.py
TESTS_FIRST = tests/test_cli.py tests/test_export.py $(TESTS_WALKTHROUGH) tests/test_learning.py \
              tests/test_benchmark.py tests/test_compiled.py tests/test_preemption.py \
              tests/test_translation_pipeline.py tests/test_resume.py tests/test_prepare_streaming.py \
              tests/test_hydra.py
TESTS = $(TESTS_FIRST) $(filter-out $(TESTS_FIRST),$(sort $(wildcard tests/test_*.py)))

.PHONY: demo demo-reverse demo-copy walkthrough walkthrough-run page test test-main test-fairseq-0.12.2 test-gpu install install310 clean clean-work FORCE

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet "$(PIP)"

# torch again whenever TORCH or TORCH_INDEX differ from the last install. --no-cache-dir: a CUDA
# build is 2.5 GB of wheels, which pip's cache would keep a second copy of (CI ran out of disk).
$(VENV)/.torch: $(PY) FORCE
	@if [ "$$(cat $@ 2>/dev/null)" != "$(TORCH) $(TORCH_INDEX)" ]; then \
	  echo "$(PY) -m pip install --no-cache-dir $(foreach p,$(TORCH),'$(p)') $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))"; \
	  ! $(PY) -m pip show -q torch 2>/dev/null || $(PY) -m pip uninstall -y -q torch; \
	  $(PY) -m pip install --no-cache-dir $(foreach p,$(TORCH),'$(p)') $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) && \
	  echo "$(TORCH) $(TORCH_INDEX)" > $@; fi

$(VENV)/.deps: setup.py $(VENV)/.torch
	$(PY) -m pip install ".[$(EXTRAS)]"
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

# examples/walkthrough: the notebook's sections on this package, in Jupyter (installs the
# walkthrough extra: JupyterLab, jupytext), or run headless, its figures written
walkthrough: install
	$(PY) -m pip install --quiet ".[walkthrough]"
	cd examples/walkthrough && $(abspath $(VENV))/bin/jupyter lab walkthrough.ipynb

# (nbclient's jupyter-execute, of the test extra: jupytext --execute needs nbconvert as well)
walkthrough-run: install
	cd examples/walkthrough && $(abspath $(VENV))/bin/jupyter-execute walkthrough.ipynb

# the walkthrough as a web page, executed from the current code, every output in place, with the
# README and docs/ beside it: site/walkthrough.html (WALKTHROUGH_FULL=1: from the full run)
page: install
	$(PY) scripts/build_page.py --site-dir site

# the notebook's first example: copying random symbols, decoded greedily
demo-copy: install
	$(PY) scripts/reverse_demo.py --task copy --work-dir $(WORK)/copy

# both lanes: this Python with fairseq-fixed, then Python 3.10 with the official fairseq 0.12.2
test: test-main test-fairseq-0.12.2

# (with the GPU lane's tests on the CPU: their code, not the GPU's paths; make test-gpu runs those)
test-main: install
	ANNOTATED_TEST_DEVICE=cpu $(call PYTEST,$(VENV)) $(TESTS)

install310:
	@test -n "$(PYTHON310)" || { echo "no python3.10 found (give it as PYTHON310=...)"; exit 1; }
	$(MAKE) --no-print-directory install $(LANE310)

# Under CI (CI=true) the lane is part of what a green run claims, so a missing python3.10 fails it.
test-fairseq-0.12.2:
	@if [ -z "$(PYTHON310)" ] && [ "$(CI)" = true ]; then \
	  echo "make test: CI=true but no python3.10 on PATH or in ~/.pyenv for the fairseq 0.12.2 lane; install one or give PYTHON310=..." >&2; \
	  exit 1; \
	elif [ -z "$(PYTHON310)" ]; then \
	  echo "SKIPPED the fairseq 0.12.2 lane: no python3.10 on PATH or in ~/.pyenv (PYTHON310=...)"; \
	else \
	  $(MAKE) --no-print-directory install $(LANE310) && \
	  ANNOTATED_REVERSE_EPOCHS=10 $(call PYTEST,$(VENV310)) -m "not main_lane" \
	    $(filter-out $(TESTS_WALKTHROUGH),$(TESTS)); fi

# the tests whose behaviour depends on the device, on a CUDA GPU (skipped, with the reason, without)
test-gpu: install
	$(PY) -m pytest -q -m cuda -rs tests

# the environments and build outputs; trained models and prepared data stay (make clean-work)
clean:
	rm -rf $(VENV) $(VENV310) build site *.egg-info

# WORK: the demos' and examples/multi30k's data, checkpoints and logs
clean-work:
	rm -rf $(WORK)

FORCE:
