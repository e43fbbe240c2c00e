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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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


#: pages run two at a time: most of a page's time is interpreters and ranks starting
#: (imports) and ranks waiting on each other, which a second page fills
CONCURRENT_PAGES = 2


def _run_page(page: Path, folder: Path) -> subprocess.CompletedProcess:
    script = folder / (page.stem + "_examples.py")
    script.write_text(page_script(page.read_text()))
    return subprocess.run([sys.executable, str(script)], cwd=folder, capture_output=True,
                          text=True, env=_env(), timeout=280)


@pytest.fixture(scope="module")
def page_runs(request, tmp_path_factory) -> Iterator[dict[Path, Future]]:
    """The selected pages' runs, submitted in the tests' order to a pool of
    :data:`CONCURRENT_PAGES`; each test waits for its own."""
    pages = [item.callspec.params["page"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_page_examples_run"]
    with ThreadPoolExecutor(CONCURRENT_PAGES) as pool:
        runs = {page: pool.submit(_run_page, page, tmp_path_factory.mktemp(page.stem))
                for page in pages}
        yield runs
        for run in runs.values():
            run.cancel()


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page, page_runs):
    result = page_runs[page].result()
    assert result.returncode == 0, (f"{page.relative_to(ROOT)}'s examples failed:\n"
                                    + result.stdout[-2000:] + result.stderr[-4000:])
