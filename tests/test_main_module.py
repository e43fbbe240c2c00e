"""``python -m shardfn``: the report's lines, the 2-rank self-check, and its exit status.

One subprocess runs the whole command (report + self-check on its own local world);
the rest runs in this process on the session's world, including a world whose results
are nudged by 1e-3, which every check must report as FAIL with a non-zero exit status.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import types

import pytest
import torch

from shardfn import _selfcheck


def test_python_m_shardfn_reports_and_passes():
    proc = subprocess.run([sys.executable, "-m", "shardfn", "--world", "2"],
                          capture_output=True, text=True, timeout=240)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    lines = out.splitlines()
    for prefix in ("  shardfn: ", "  python: ", "  torch: 2.", "  optree: ", "optional: ",
                   "backends: gloo yes", "device cpu: ", "device cuda", "device mps: ",
                   "imported from: ", "self-check on a local world of 2 CPU ranks"):
        assert any(line.startswith(prefix) for line in lines), (prefix, out)
    assert sum(line.startswith("  PASS  ") for line in lines) == 2, out
    assert "FAIL" not in out and lines[-1].startswith("PASS ("), out


def test_no_check_prints_the_report_only(capsys):
    assert _selfcheck.main(["--no-check"]) == 0
    out = capsys.readouterr().out
    assert f"  torch: {torch.__version__}" in out and "self-check" not in out
    for name, version in _selfcheck.optional_packages().items():
        assert (f"{name} {version}" if version else name) in out


def test_bad_world_size_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        _selfcheck.main(["--world", "0"])
    assert exit_info.value.code == 2 and "--world" in capsys.readouterr().err


class _Nudged:
    """A world whose rank 1 returns every tensor off by 1e-3: a wrong number to catch."""

    def __init__(self, world):
        self.size = world.size
        self._world = world

    def run(self, fn, *args):
        results = self._world.run(fn, *args)
        results[1] = {k: v + 1e-3 for k, v in results[1].items()}
        return results


def test_checks_pass_on_the_world_and_fail_on_a_wrong_number(worlds, capsys):
    world = worlds(2)
    assert [r.passed for r in _selfcheck.run_checks(world)] == [True, True]
    nudged = _selfcheck.run_checks(_Nudged(world))
    assert [r.passed for r in nudged] == [False, False]
    assert all(r.detail.startswith("rank 1, ") for r in nudged), nudged

    status = _selfcheck.main(["--world", "2"],
                             open_world=lambda n: contextlib.nullcontext(_Nudged(world)))
    out = capsys.readouterr().out
    assert status == 1 and out.count("  FAIL  ") == 2 and out.splitlines()[-1].startswith("FAIL")


def test_a_check_that_raises_is_a_failure():
    class Broken:
        size = 2

        def run(self, fn, *args):
            raise RuntimeError("rank 0 failed:\n  Traceback ...\n  ValueError: bad leaf")

    results = _selfcheck.run_checks(Broken())
    assert [r.detail for r in results] == \
        ["RuntimeError: rank 0 failed: ... ValueError: bad leaf"] * 2
    assert not any(r.passed for r in results)


def test_install_warnings_name_a_folder_that_would_hide_shardfn(tmp_path):
    (tmp_path / "shardfn").mkdir()
    hook = ["__editable___shardfn_0_1_0_finder"]  # setuptools' import-hook editable install
    found = _selfcheck.install_warnings([str(tmp_path)], hooks=hook)
    assert len(found) == 2 and "import hook" in found[0], found
    assert str(tmp_path / "shardfn") in found[1], found
    assert _selfcheck.install_warnings([str(tmp_path)], hooks=["_frozen_importlib"]) == []
    (tmp_path / "shardfn" / "__init__.py").write_text("")  # a regular package: not hidden
    assert len(_selfcheck.install_warnings([str(tmp_path)], hooks=hook)) == 1


def test_shadowed_explains_an_empty_namespace_package(tmp_path, monkeypatch):
    assert _selfcheck.shadowed() is None
    namespace = types.ModuleType("shardfn")
    namespace.__path__ = [str(tmp_path / "shardfn")]
    monkeypatch.setitem(sys.modules, "shardfn", namespace)
    why = _selfcheck.shadowed()
    assert why is not None and str(tmp_path / "shardfn") in why and "namespace" in why
    assert _selfcheck.main(["--no-check"]) == 1
