"""A folder named ``shardfn`` beside the user's script must not hide the installed shardfn.

Python imports a folder without ``__init__.py`` as an empty namespace package when no
regular ``shardfn`` is found on ``sys.path``; setuptools' default editable install of a
flat layout is an import hook searched after ``sys.path``, so a ``git clone`` named
``shardfn`` in the working directory won and ``shardfn.optim`` was missing.
pyproject.toml's ``package-dir`` makes ``pip install -e .`` write a path entry instead,
which beats the folder. Each case runs a fresh interpreter in ``tmp_path`` (the
interpreter and install of this test run), with the folder in the working directory
(``python -c``) and beside a script (``python script.py``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

#: where ``import shardfn`` would load from, asked of the import system itself (the same
#: finders in the same order as ``import``) without running shardfn: a namespace package
#: has no origin file
PROBE = ("import importlib.util\n"
         "spec = importlib.util.find_spec('shardfn')\n"
         "print(spec.origin if spec.has_location else "
         "f'a namespace package over {list(spec.submodule_search_locations)}')\n")


def _folders(root: Path, kind: str) -> None:
    """An empty ``shardfn/`` folder, or a clone-like tree: no ``__init__.py`` at its top."""
    (root / "shardfn").mkdir()
    if kind == "clone":
        (root / "shardfn" / "README.md").write_text("# shardfn\n")
        (root / "shardfn" / "shardfn").mkdir()
        (root / "shardfn" / "shardfn" / "__init__.py").write_text("")  # not ours to import


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the install alone
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """Where this interpreter imports shardfn from in a folder with nothing beside it."""
    proc = _run(["-c", PROBE], tmp_path_factory.mktemp("plain"))
    origin = proc.stdout.strip()
    if proc.returncode != 0 or not origin or origin.startswith("a namespace"):
        pytest.skip(f"shardfn is not installed in {sys.executable}: {proc.stdout}{proc.stderr}")
    return origin


@pytest.mark.parametrize("kind", ["empty", "clone"])
@pytest.mark.parametrize("how", ["cwd", "script"])
def test_a_shardfn_folder_beside_the_script_does_not_hide_the_install(tmp_path, kind, how,
                                                                      installed):
    _folders(tmp_path, kind)
    if how == "script":
        (tmp_path / "train.py").write_text(PROBE)
        proc = _run(["train.py"], tmp_path)
    else:
        proc = _run(["-c", PROBE], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == installed, (
        f"`import shardfn` beside a folder named shardfn would load {proc.stdout.strip()}; "
        f"the editable install is probably setuptools' import hook (made before "
        f"pyproject.toml's package-dir): reinstall with `pip install -e .` (or `make`).")
