"""No committed file names a path of the machine it was made on (a benchmark report that
pastes the checkout's absolute path, or a temporary file's, is a defect)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the checkout itself, and the names Python's tempfile makes ("tmp" and 8 random characters
# in the temporary directory): paths that only exist on the machine that wrote them
TEMPFILE = re.compile(re.escape(tempfile.gettempdir()) + r"/tmp[a-z0-9_]{6,}")


def _tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in listed:
        path = ROOT / name
        if path.suffix in {".png", ".jpg", ".gif", ".ico", ".pt", ".bin"} or not path.is_file():
            continue
        files.append(path)
    return files


def test_no_tracked_file_names_this_checkout_or_a_temporary_file():
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        if str(ROOT) + "/" in text or TEMPFILE.search(text):
            found.append(str(path.relative_to(ROOT)))
    assert not found, f"machine paths in {found}: write paths relative to the repository"
