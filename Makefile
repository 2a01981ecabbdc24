# zero-offload: every target installs what it needs on first use (.venv, pinned).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LAB_DIR ?= labs
# Two workers: the machine the course targets has two cores.
PYTEST_WORKERS ?= 2

.PHONY: install test demo build labs lessons jupyter bench lint gpu-check clean \
        lab1 lab2 lab3 lab4 lab5 train-multinode demo-multinode site serve-site site-check

install: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "zero-offload needs Python 3.10 or newer (3.11 recommended); set PYTHON=python3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[dev]'
	@touch $(STAMP)

# No test asserts a measured time: speeds are reported by `make bench`.
test: $(STAMP)
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --durations=15 tests

# Two ranks under torchrun on loopback, an emulated 512 MB device; report and plots in out/demo/.
demo: $(STAMP)
	$(VENV)/bin/zo demo

# The same demo over two torchrun "nodes" on this machine, one rank each; report in out/demo-multinode/.
demo-multinode: $(STAMP)
	$(PY) tools/multinode.py --command demo --nodes 2 -- --out out/demo-multinode

# Two torchrun "nodes" on this machine, one rank each, meeting on loopback: the multi-node path without a second
# machine. Report, plots and checkpoints in out/train-multinode/.
train-multinode: $(STAMP)
	$(PY) tools/multinode.py --nodes 2 -- --model tiny --steps 60 --eval-every 20 --save-every 20 \
		--out out/train-multinode

# Compile the C CPU Adam now (it is otherwise compiled on first use, into ~/.cache/zero_offload).
build: $(STAMP)
	$(PY) -c "from zero_offload.tuning.build import main; raise SystemExit(main())"

lab1 lab2 lab3 lab4 lab5: $(STAMP)
	$(VENV)/bin/zo grade $(subst lab,,$@) --lab-dir $(LAB_DIR)

labs: $(STAMP)
	$(PY) tools/make_labs.py

lessons: $(STAMP)
	$(PY) tools/run_lessons.py

jupyter: $(STAMP)
	$(VENV)/bin/jupyter lab --ip=127.0.0.1 --notebook-dir=lessons

# The course as an offline static website in out/site/ (chapters, lessons with their stored outputs, labs, API).
site: $(STAMP)
	$(PY) -m tools.build_site

SITE_PORT ?= 8000
serve-site:
	@test -f out/site/index.html || $(MAKE) site
	$(PYTHON) -m http.server --bind 127.0.0.1 --directory out/site $(SITE_PORT)

# Opens the built site in Chromium (Debian's, through Playwright): math, images, CJK glyphs, Chinese search,
# answering a choice and a number quiz question (wrong, then right).
# Screenshots and report.json in out/site-check/.
site-check: site
	$(PY) -m tools.check_site

bench: $(STAMP)
	$(VENV)/bin/zo bench

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tools examples
	$(VENV)/bin/ruff format --check src tests tools examples

# One prepared smoke test of the CUDA path, minutes on one GPU. It installs nothing: a bare checkout runs it with
# the machine's own Python and torch. Without CUDA it says so and exits 0. Figures: out/gpu-check/results.json.
gpu-check:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} $(if $(wildcard $(PY)),$(PY),$(PYTHON)) -m tools.gpu_check

clean:
	rm -rf out .pytest_cache
