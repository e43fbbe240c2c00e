"""No committed file names a path of the machine it was made on (a benchmark report that
pastes the checkout's absolute path, a home directory or a temporary file's, is a defect).

Two kinds of checks: the paths of *this* machine (the checkout, the home directory, the
temporary directory's generated names), and the shapes such paths have on *any* machine,
so that a path written on another machine is caught here too: a user's home directory
(Linux's, macOS's, root's), macOS's temporary folders, generated temporary names (Python's
``tmpXXXXXXXX``, ``PREFIX_XXXXXXXX`` of ``mkdtemp``, pytest's) and an absolute path into a
checkout of this repository (one that goes on with ``docs/``, ``tests/``...). A
hand-written example such as ``--img-dir /tmp/pp`` is not a machine's path and passes
(:data:`PATTERNS` has the shapes).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_START = r"(?<![\w.~:/-])"  # a path starts the text or follows a space, quote, bracket...
#: name -> the shape of a machine's path, on any machine
PATTERNS = {
    "a user's home directory": re.compile(_START + r"/(?:home|Users)/[\w.-]+/"),
    "root's home directory": re.compile(_START + "/" + r"root/[\w.-]"),
    "a macOS temporary folder": re.compile(_START + r"(?:/private)?/var/folders/\w"),
    "a generated temporary name": re.compile(
        _START + r"/(?:tmp|var/tmp)/(?:tmp[a-z0-9_]{6,}|pytest-of-|[\w.+-]*[_-][a-z0-9_]{8}"
        r"(?![\w-]))"),
    "an absolute path into a checkout": re.compile(
        _START + r"(?:/[\w.+-]+)+/(?:benchmarks|docs|tests|examples|shardfn|\.venv)/"),
    "a Windows user's folder": re.compile(r"[A-Za-z]:\\{1,2}Users\\{1,2}"),
}
BINARY = {".png", ".jpg", ".gif", ".ico", ".pt", ".bin", ".svg", ".woff", ".woff2"}


def this_machines_paths() -> list[str]:
    """The prefixes that only exist here: the checkout, the home and temporary dirs."""
    paths = {str(ROOT), os.path.expanduser("~"), tempfile.gettempdir()}
    return sorted(p + "/" for p in paths if p not in ("/", "", "/tmp"))


def machine_paths(text: str) -> list[str]:
    """Every machine path in ``text``, as found (empty when there is none).

    Example:
        >>> machine_paths("see docs/benchmark_report.md, written to --img-dir /tmp/pp")
        []
    """
    found = [p for p in this_machines_paths() if p in text]
    for pattern in PATTERNS.values():
        found += [m.group(0) for m in pattern.finditer(text)]
    return found


def _tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                                cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in listed
            if Path(name).suffix not in BINARY and (ROOT / name).is_file()]


def test_no_file_of_the_repository_names_a_machine_path():
    found = {}
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if hits := machine_paths(text):
            found[str(path.relative_to(ROOT))] = hits[:3]
    assert not found, f"machine paths in {found}: write paths relative to the repository"


# the samples are assembled from pieces so that this file does not name them itself
HOME, USERS, TMP = "/" + "home/", "/" + "Users/", "/" + "tmp/"


@pytest.mark.parametrize("sample", [
    f"{HOME}alice/shardfn/x.py", f"saved to {USERS}bob/ckpt", "/" + "root/.cache/x",
    "/" + "var/folders/xy/T/abc", f"{TMP}tmpa1b2c3d4/report.json", f"{TMP}pytest-of-carol/x",
    f"{TMP}bench_pp_k3j9x0qz/timeline.png", "(/srv/ci/build" + "/docs/benchmark_report.md)",
    "C:\\" + "Users\\dave\\x",
])
def test_the_check_catches_a_machine_path(sample):
    assert machine_paths(sample), sample


@pytest.mark.parametrize("sample", [
    "docs/benchmark_report.md", "python benchmarks/bench_pp.py --img-dir " + TMP + "pp",
    "https://github.com/org/shardfn/blob/main/docs/index.md", "~/.cache/huggingface",
    TMP + "shardfn-demo-<plan>",
])
def test_the_check_lets_a_relative_path_or_an_example_through(sample):
    assert not machine_paths(sample), sample


def test_the_check_catches_this_checkout():
    assert machine_paths(f"wrote {ROOT}/docs/img/x.png")
    assert machine_paths(f"{ROOT}{os.sep}README.md")
