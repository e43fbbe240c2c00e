"""The tutorials in docs/notebooks run top to bottom, and the outputs stored in them are current.

The docs site shows each notebook with the outputs stored in its ``.ipynb`` (mkdocs-jupyter
with ``execute: false``: the build stays fast and needs no local world). So each test runs a
notebook in a fresh kernel (nbclient) and checks two things: no cell raises (the failure names
the cell and the error), and the stored outputs match the fresh ones cell by cell: the same
kinds (printed text, a value, an image) and the same text. A cell whose numbers change from
run to run (a measured time) carries ``"volatile_output": true`` in its cell metadata (not a
tag: the site would show tags): its digits are masked before comparing, so a new line, a
missing plot or a stale table still fails.

Refresh the stored outputs after editing a notebook (it rewrites the ``.ipynb`` files)::

    python -m tests.test_notebooks [docs/notebooks/NAME.ipynb ...]
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "docs" / "notebooks").glob("*.ipynb"))
_DIGITS = re.compile(r"\d+")
VOLATILE = "volatile_output"  # cell metadata key: this cell's numbers change between runs
# outputs that carry no tutorial content and may come and go between runs
_VOLATILE_STREAMS = {"stderr"}


def execute(path: Path, workdir: Path):
    """The notebook at ``path`` run top to bottom in a fresh kernel whose cwd is ``workdir``.

    Args:
        path: A ``.ipynb`` file.
        workdir: Where the cells run (files they write land there, not in docs/).

    Returns:
        The executed ``nbformat.NotebookNode`` (outputs filled in, no timing metadata).

    Example:
        >>> execute(NOTEBOOKS[0], tmp_path).cells[1].outputs[0].output_type
        'execute_result'
    """
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=240, kernel_name="python3",
                                     record_timing=False, coalesce_streams=True,
                                     resources={"metadata": {"path": str(workdir)}})
    saved = dict(os.environ)  # the kernel inherits this process's environment
    os.environ["PYTHONPATH"] = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return notebook


def output_summary(cell) -> list[tuple[str, str]]:
    """What a code cell shows, as (kind, text) pairs, in order.

    Args:
        cell: A code cell of an executed notebook.

    Returns:
        One pair per output: ``("stream", text)``, ``("text/plain", text)`` for a value,
        ``("image/png", "")`` for a plot (the bytes change from run to run), ``("error", name)``.
        stderr streams (warnings) are left out; in a cell whose metadata has
        ``volatile_output`` every run of digits reads ``#``.

    Example:
        >>> output_summary({"metadata": {"volatile_output": True}, "outputs": [
        ...     {"output_type": "stream", "name": "stdout", "text": "took 2.31 s\\n"}]})
        [('stream', 'took #.# s\\n')]
    """
    summary: list[tuple[str, str]] = []
    for out in cell.get("outputs", []):
        kind = out["output_type"]
        if kind == "stream":
            if out["name"] in _VOLATILE_STREAMS:
                continue
            if summary and summary[-1][0] == "stream":  # one print may arrive in pieces
                summary[-1] = ("stream", summary[-1][1] + out["text"])
            else:
                summary.append(("stream", out["text"]))
        elif kind == "error":
            summary.append(("error", out["ename"]))
        else:  # execute_result, display_data: the richest form a browser shows
            data = out["data"]
            mime = next((m for m in ("image/png", "image/svg+xml", "text/html") if m in data),
                        "text/plain")
            summary.append((mime, "" if mime.startswith("image/") else str(data[mime])))
    if cell.get("metadata", {}).get(VOLATILE):
        return [(kind, _DIGITS.sub("#", text)) for kind, text in summary]
    return summary


def stale_cells(stored, fresh) -> list[str]:
    """The code cells whose stored outputs differ from a fresh run's, described.

    Args:
        stored: The notebook as read from disk.
        fresh: The same notebook after ``execute``.

    Returns:
        One line per stale cell (its index, first source line, stored and fresh summaries);
        empty when every stored output is current.

    Example:
        >>> stale_cells(nb_without_outputs, execute(path, tmp_path))[0][:8]
        'cell 1 ('
    """
    stale = []
    for index, (old, new) in enumerate(zip(stored.cells, fresh.cells, strict=True)):
        if new.cell_type != "code":
            continue
        if output_summary(old) != output_summary(new) or old.get("execution_count") is None:
            first = new.source.strip().splitlines()[0] if new.source.strip() else ""
            stale.append(f"cell {index} ({first[:60]!r}): stored {output_summary(old)!r:.300}"
                         f" but a fresh run shows {output_summary(new)!r:.300}")
    return stale


def test_there_are_at_least_three_tutorials():
    assert len(NOTEBOOKS) >= 3, [p.name for p in NOTEBOOKS]


def test_stale_cells_flags_missing_changed_and_unexecuted_outputs():
    nbformat = pytest.importorskip("nbformat")
    cell = nbformat.v4.new_code_cell("print(1)", execution_count=1, outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="total 10\n")])
    fresh = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# t"), cell])
    assert stale_cells(nbformat.from_dict(fresh), fresh) == []
    other_digits = nbformat.from_dict(fresh)
    other_digits.cells[1].outputs[0].text = "total 12\n"
    assert [line[:6] for line in stale_cells(other_digits, fresh)] == ["cell 1"]
    for notebook in (other_digits, fresh):  # a measured time: digits may change, text not
        notebook.cells[1].metadata[VOLATILE] = True
    assert stale_cells(other_digits, fresh) == []
    missing = nbformat.from_dict(fresh)
    missing.cells[1].outputs = []
    changed = nbformat.from_dict(fresh)
    changed.cells[1].outputs[0].text = "sum 10\n"
    unexecuted = nbformat.from_dict(fresh)
    unexecuted.cells[1].execution_count = None
    plot = nbformat.from_dict(fresh)
    plot.cells[1].outputs = [nbformat.v4.new_output("display_data", data={"image/png": "AAAA"})]
    for stored in (missing, changed, unexecuted, plot):
        assert [line[:6] for line in stale_cells(stored, fresh)] == ["cell 1"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs_and_its_stored_outputs_are_current(path, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    fresh = execute(path, tmp_path)
    errors = [f"cell {i}: {out['ename']}: {out['evalue']}\n{cell.source}"
              for i, cell in enumerate(fresh.cells) if cell.cell_type == "code"
              for out in cell.get("outputs", []) if out.get("output_type") == "error"]
    assert not errors, "\n\n".join(errors)
    stale = stale_cells(nbformat.read(path, as_version=4), fresh)
    assert not stale, (f"{path.name}'s stored outputs are not those of a fresh run (the docs "
                       "site shows them): run `python -m tests.test_notebooks` and commit\n"
                       + "\n".join(stale))


def _refresh(paths: list[Path]) -> None:
    """Execute each notebook and store its outputs (what the docs site shows)."""
    import nbformat

    for path in paths:
        with tempfile.TemporaryDirectory() as workdir:
            executed = execute(path, Path(workdir))
        errors = [out for cell in executed.cells if cell.cell_type == "code"
                  for out in cell.get("outputs", []) if out.get("output_type") == "error"]
        if errors:
            raise SystemExit(f"{path.name}: a cell raised {errors[0]['ename']}: "
                             f"{errors[0]['evalue']}; outputs not stored")
        text = nbformat.writes(executed)
        leaked = [p for p in (str(ROOT), tempfile.gettempdir() + "/") if p in text]
        if leaked:
            raise SystemExit(f"{path.name}: outputs name machine paths {leaked}; not stored")
        path.write_text(text)
        print(f"stored the outputs of {path.relative_to(ROOT)}")


if __name__ == "__main__":
    _refresh([Path(a).resolve() for a in sys.argv[1:]] or NOTEBOOKS)
