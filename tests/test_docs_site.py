"""The docs site as a reader sees it: built once (``mkdocs build --strict``), served on
127.0.0.1, opened in headless Chromium at 1280 px.

Without a browser only the build checks run; the browser tests skip and say what to install.
Each page is opened with a small probe script injected by the test server: it measures the
page in the browser (does anything scroll sideways? did the notebook's plot load? does the
search box find anything?) and posts what it saw back to the server. Screenshots of a few
pages are checked for size and content (they land in pytest's temporary folder, to look at).
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_PAGE = "notebooks/03_2d_3d_parallelism_and_pipeline_timeline/"
WIDTH, HEIGHT = 1280, 900
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")

# Runs in the page; posts one JSON report to the test server. With ?q= in the URL it waits
# (up to 15 s) for the search worker to list results; otherwise for the load event.
PROBE_JS = """
(function () {
  const started = Date.now();
  const searching = new URLSearchParams(location.search).has("q");
  function overflowing() {
    const code = ".md-content pre, .md-content pre > code, .jp-OutputArea-output";
    return [...document.querySelectorAll(code)]
      .filter((el) => el.scrollWidth > el.clientWidth + 1)
      .map((el) => el.textContent.trim().slice(0, 80));
  }
  function report() {
    const meta = document.querySelector(".md-search-result__meta");
    const images = [...document.querySelectorAll(".md-content img")];
    fetch("/__probe__", {method: "POST", body: JSON.stringify({
      probe: new URLSearchParams(location.search).get("probe"),
      page: location.pathname,
      innerWidth: window.innerWidth,
      scrollWidth: document.documentElement.scrollWidth,
      overflowing: overflowing(),
      searchMeta: meta ? meta.textContent.trim() : null,
      searchHits: [...document.querySelectorAll(".md-search-result__item a")]
        .map((a) => a.getAttribute("href")),
      imagesLoaded: images.filter((img) => img.complete && img.naturalWidth > 0).length,
      images: images.length,
      notebookOutputs: document.querySelectorAll(".jp-OutputArea-output").length,
      doctestPrompts: document.querySelectorAll(".doc .highlight .gp").length,
      headings: [...document.querySelectorAll(".doc-heading")].map((h) => h.id),
      repoLink: document.querySelector(".md-source") !== null,
      ms: Date.now() - started,
    })});
  }
  function poll() {
    const hits = document.querySelectorAll(".md-search-result__item").length;
    if (searching && hits === 0 && Date.now() - started < 15000) setTimeout(poll, 100);
    else report();
  }
  if (document.readyState === "complete") setTimeout(poll, 50);
  else window.addEventListener("load", () => setTimeout(poll, 50));
})();
"""


def build_site(dest: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of this repository's site into ``dest``.

    Args:
        dest: The output folder (``site/`` for ``make docs``).

    Returns:
        The finished process (its returncode, stdout and stderr).

    Example:
        >>> build_site(tmp_path / "site").returncode
        0
    """
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q",
                           "-f", str(ROOT / "mkdocs.yml"), "-d", str(dest)],
                          capture_output=True, text=True, env=env, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs")  # mkdocs-jupyter etc. missing: the build fails and says so
    dest = tmp_path_factory.mktemp("docs") / "site"
    result = build_site(dest)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return dest


class _Server:
    """The built site over HTTP on 127.0.0.1; a page asked for with ``?probe=ID`` gets the
    probe script, whose report lands in ``reports``."""

    def __init__(self, site: Path):
        self.reports: queue.Queue = queue.Queue()
        reports, probe = self.reports, PROBE_JS.encode()

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                length = int(self.headers["Content-Length"])
                reports.put(json.loads(self.rfile.read(length)))
                self.send_response(204)
                self.end_headers()

            def do_GET(self):
                path, _, query = self.path.partition("?")
                if path == "/__probe__.js":
                    return self._send(probe, "text/javascript")
                file = Path(self.translate_path(path))
                file = file / "index.html" if file.is_dir() else file
                if "probe=" in query and file.suffix == ".html" and file.is_file():
                    html = file.read_text().replace(
                        "</body>", '<script src="/__probe__.js"></script></body>')
                    return self._send(html.encode(), "text/html; charset=utf-8")
                return super().do_GET()

            def _send(self, body: bytes, content_type: str):
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=str(site)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def browser() -> str:
    for name in BROWSERS:
        if path := shutil.which(name):
            return path
    pytest.skip("no chromium/chrome binary: apt-get install chromium")


@pytest.fixture(scope="module")
def server(site):
    served = _Server(site)
    yield served
    served.httpd.shutdown()
    served.httpd.server_close()


def _chromium(browser: str, profile: Path, *args: str) -> list[str]:
    return [browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--disable-extensions", "--hide-scrollbars", f"--user-data-dir={profile}",
            f"--window-size={WIDTH},{HEIGHT}", *args]


def probe(browser: str, server: _Server, page: str, tmp_path: Path, query: str = "") -> dict:
    """What the probe script saw on ``page`` (a path under the site) opened with ``query``."""
    token = f"{page}-{query}-{time.monotonic_ns()}"
    url = f"{server.url}{page}?probe={urllib.parse.quote(token)}&{query}"
    log = tmp_path / "chromium.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(_chromium(browser, tmp_path / "profile", url),
                                   stdout=subprocess.DEVNULL, stderr=stderr)
        deadline = time.monotonic() + 60
        try:
            while True:  # a report of an earlier page (its browser long gone) is skipped
                seen = server.reports.get(timeout=max(deadline - time.monotonic(), 0.01))
                if seen["probe"] == token:
                    return seen
        except queue.Empty:
            pytest.fail(f"no report from the page {page} within 60 s; chromium said:\n"
                        + log.read_text()[-2000:])
        finally:  # SIGTERM: chromium closes its helper processes too
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_site_builds_strict_with_rendered_examples_and_notebooks(site):
    api = (site / "api" / "index.html").read_text()
    # `Example:` sections are code blocks (a doctest prompt per line), not flattened quotes
    assert api.count('<span class="gp">&gt;&gt;&gt; </span>') > 100
    assert "<blockquote>" not in api
    assert not re.findall(r'id="[\w.]*\.__\w+__"', api), "dunders listed as API"
    assert "example.invalid" not in (site / "index.html").read_text()
    notebook = (site / NOTEBOOK_PAGE / "index.html").read_text()
    assert "jp-OutputArea-output" in notebook and "data:image/png;base64" in notebook
    assert 'href="notebooks/01_collectives_and_specs/"' in (site / "index.html").read_text()


@pytest.mark.parametrize("page", ["", "api/", NOTEBOOK_PAGE, "tensor_parallel/"])
def test_page_fits_1280px_without_sideways_scrolling(page, browser, server, tmp_path):
    seen = probe(browser, server, page, tmp_path)
    assert seen["innerWidth"] == WIDTH, seen
    assert seen["scrollWidth"] <= WIDTH, f"{page or 'index'} is {seen['scrollWidth']} px wide"
    assert seen["overflowing"] == [], f"code that scrolls sideways on {page or 'index'}"
    assert not seen["repoLink"], "the header links to a repository that does not exist"
    if page == "api/":
        assert seen["doctestPrompts"] > 100, seen["doctestPrompts"]
        assert not [h for h in seen["headings"] if re.search(r"\.__\w+__$", h)]
    if page == NOTEBOOK_PAGE:  # the stored outputs: printed text and the timeline plot
        assert seen["notebookOutputs"] >= 5 and seen["imagesLoaded"] == seen["images"] >= 1


def test_search_finds_pages_and_notebooks(browser, server, tmp_path):
    seen = probe(browser, server, "", tmp_path, "q=timeline")
    assert re.fullmatch(r"\d+ matching documents?", seen["searchMeta"] or ""), seen["searchMeta"]
    assert any("notebooks/" in hit for hit in seen["searchHits"]), seen["searchHits"]
    seen = probe(browser, server, "api/", tmp_path, "q=psum_scatter")  # from a nested page
    assert seen["searchHits"] and all(hit.startswith(server.url) for hit in seen["searchHits"])
    assert any("collectives/" in hit for hit in seen["searchHits"]), seen["searchHits"]


@pytest.mark.parametrize("page", ["", "api/", NOTEBOOK_PAGE])
def test_screenshot_shows_the_page(page, browser, server, tmp_path):
    image_module = pytest.importorskip("PIL.Image")
    shot = tmp_path / ((page.strip("/").replace("/", "_") or "index") + ".png")
    subprocess.run(_chromium(browser, tmp_path / "profile", f"--screenshot={shot}",
                             "--virtual-time-budget=5000", server.url + page),
                   capture_output=True, timeout=60, check=False)
    assert shot.exists(), f"chromium wrote no screenshot of {page or 'index'}"
    with image_module.open(shot) as image:
        assert image.size == (WIDTH, HEIGHT)
        pixels = image.convert("L").resize((WIDTH // 4, HEIGHT // 4))
        values = pixels.tobytes()  # one byte per pixel
    ink = sum(v < 200 for v in values) / len(values)   # text, code, header, plot
    assert 0.02 < ink < 0.6, f"{shot.name}: {ink:.1%} dark pixels (blank or not drawn?)"
    assert len(set(values)) > 32, f"{shot.name}: only {len(set(values))} grey levels"


def test_site_opened_as_a_file_says_how_to_get_search(site, browser, tmp_path):
    # browsers start no web worker for a file:// page: search cannot initialise there
    result = subprocess.run(_chromium(browser, tmp_path / "profile", "--dump-dom",
                                      "--virtual-time-budget=3000",
                                      (site / "index.html").as_uri()),
                            capture_output=True, text=True, timeout=60, check=False)
    assert "Search needs the site served: make docs-serve" in result.stdout, result.stderr[-2000:]
