# `make demo` and `make test` create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench bench-gpu docs docs-serve notebooks

# Reinstalled when pyproject.toml or this file changes (an install older than pyproject's
# package-dir is setuptools' import hook, which a folder named shardfn can hide).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check shardfn tests examples benchmarks docs/notebooks docs/_ext

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	# DeepSpeed-MoE, the expert-parallel peer of bench_moe (runs on CPU gloo with
	# DS_ACCELERATOR=cpu); built against the installed torch, so no other torch is fetched
	$(PY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	$(PY) benchmarks/report.py   # every benchmark -> docs/benchmark_report.md + plots

# One GPU for <= 10 minutes: the CUDA-only tests and the eager and compiled benchmarks;
# installs nothing (the GPU machine reaches no registry). Plan: bash benchmarks/gpu.sh --dry-run
bench-gpu:
	bash benchmarks/gpu.sh

docs: $(STAMP)
	$(PY) -m mkdocs build --strict -d site

docs-serve: docs   # search needs a server: opened as a file, the site cannot search
	$(PY) -m http.server --bind 127.0.0.1 --directory site 8000

notebooks: $(STAMP)   # re-run the tutorials and store their outputs (what the site shows)
	$(PY) -m tests.test_notebooks
