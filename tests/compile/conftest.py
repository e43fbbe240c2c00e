"""The compile tests' marker: ``-m "not inductor"`` leaves out the one test that runs
inductor's C++ compiler (about a minute on 2 cores)."""

from __future__ import annotations


def pytest_configure(config):
    config.addinivalue_line("markers", "inductor: compiles with inductor's C++ backend (slow)")
