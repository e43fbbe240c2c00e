"""The docs cannot rot: every page's examples run (the site's ``--strict`` build, and what a
browser shows of it, are checked in tests/test_docs_site.py).

Each page's ```` ```python ```` blocks run in order as one script (so a later
block may use an earlier one's names), in a fresh interpreter, as a user who
copies them would. A block whose first line is ``# not run: <why>`` is skipped
(a torchrun command, a fragment shown for its shape); the reason is required.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_SKIP = re.compile(r"#[ \t]*not run:[ \t]*\S")


def page_script(text: str) -> str | None:
    """The page's runnable python blocks joined in order (None: it has none)."""
    blocks = [b for b in _BLOCK.findall(text) if not _SKIP.match(b.lstrip())]
    return "\n\n".join(blocks) if blocks else None


def _pages() -> list[Path]:
    pages = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
    return [p for p in pages if page_script(p.read_text())]


def test_page_script_joins_blocks_and_honours_skips():
    text = ("x\n```python\na = 1\n```\n```python\n# not run: torchrun only\nboom()\n```\n"
            "```python\nprint(a)\n```\n```bash\nls\n```\n")
    assert page_script(text) == "a = 1\n\n\nprint(a)\n"
    assert page_script("```python\n# not run:\nx\n```\n") == "# not run:\nx\n"  # no reason
    assert page_script("no code") is None


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["NO_MKDOCS_2_WARNING"] = "1"
    return env


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, tmp_path):
    script = tmp_path / (page.stem + "_examples.py")
    script.write_text(page_script(page.read_text()))
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                            text=True, env=_env(), timeout=280)
    assert result.returncode == 0, (f"{page.relative_to(ROOT)}'s examples failed:\n"
                                    + result.stdout[-2000:] + result.stderr[-4000:])
