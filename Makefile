# `make demo` and `make test` create the virtual environment on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test lint bench docs

# Reinstalled when pyproject.toml or this file changes (an install older than pyproject's
# package-dir is setuptools' import hook, which a folder named shardfn can hide).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

lint: $(STAMP)
	$(PY) -m ruff check shardfn tests examples benchmarks docs/notebooks

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) benchmarks/report.py   # every benchmark -> docs/benchmark_report.md + plots

docs: $(STAMP)
	$(PY) -m mkdocs build --strict -d site
