"""sf.log: once-per-job and per-rank lines on a 2-rank world, the prefix, and progress that
never writes ``\\r`` into a pipe (a tqdm bar only on a terminal)."""

from __future__ import annotations

import io
import logging
import os
import sys

import pytest

import shardfn as sf


def _log_on_rank(name: str) -> dict[str, str]:
    """On every rank: each kind of line through a handler of each kind; what each wrote."""
    outputs = {}
    mesh = sf.Mesh({"dp": 1, "tp": 2})
    for ranks in ("0", "all"):
        stream = io.StringIO()
        logger_name = f"{name}.{ranks}"
        handler = sf.log.setup(ranks=ranks, name=logger_name, stream=stream)
        try:
            log = sf.log.get_logger(logger_name)
            log.info("step %d of this rank", 3)
            log.info("once per job", main_process_only=True)
            log.info("on the mesh", mesh=mesh)
            sf.log.get_logger(logger_name, mesh=mesh).warning("bound mesh")
            log.debug("below the level")
            sf.log.rank_zero_info("rank zero %s", "info", logger=logger_name)
        finally:
            logging.getLogger(logger_name).removeHandler(handler)
        outputs[ranks] = stream.getvalue()
    outputs["prefix"] = sf.log.rank_prefix()
    outputs["mesh_prefix"] = sf.log.rank_prefix(mesh)
    return outputs


def test_rank_filter_and_prefix_on_two_ranks(worlds):
    rank0, rank1 = worlds(2).run(_log_on_rank, "test_log_two_ranks")
    # ranks="0": a log of the job, rank 0 alone, no prefix
    assert rank0["0"] == ("step 3 of this rank\nonce per job\non the mesh\nbound mesh\n"
                          "rank zero info\n")
    assert rank1["0"] == ""
    # ranks="all": every rank, tagged; main_process_only lines on rank 0 alone, untagged
    assert rank0["all"] == ("[rank 0/2] step 3 of this rank\nonce per job\n"
                            "[dp=0 tp=0] on the mesh\n[dp=0 tp=0] bound mesh\nrank zero info\n")
    assert rank1["all"] == ("[rank 1/2] step 3 of this rank\n"
                            "[dp=0 tp=1] on the mesh\n[dp=0 tp=1] bound mesh\n")
    assert (rank0["prefix"], rank1["prefix"]) == ("[rank 0/2]", "[rank 1/2]")
    assert (rank0["mesh_prefix"], rank1["mesh_prefix"]) == ("[dp=0 tp=0]", "[dp=0 tp=1]")


def test_rank_without_a_process_group(monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert sf.log.rank_and_world() == (0, 1)
    assert sf.log.rank_prefix() == ""            # a world of one: nothing to tell apart
    monkeypatch.setenv("RANK", "3")              # torchrun, before initialize()
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert sf.log.rank_and_world() == (3, 4)
    assert sf.log.rank_prefix() == "[rank 3/4]"
    stream = io.StringIO()
    handler = sf.log.setup(ranks="all", name="test_log_env", stream=stream)
    try:
        sf.log.get_logger("test_log_env").info("mine")
        sf.log.get_logger("test_log_env").info("the job's", main_process_only=True)
    finally:
        logging.getLogger("test_log_env").removeHandler(handler)
    assert stream.getvalue() == "[rank 3/4] mine\n"   # rank 3 does not print the job's line


def test_setup_replaces_its_handler_and_checks_its_arguments():
    name = "test_log_setup"
    logger = logging.getLogger(name)
    first = sf.log.setup(name=name, stream=io.StringIO())
    second = sf.log.setup(level="DEBUG", name=name, stream=io.StringIO())
    try:
        assert logger.handlers == [second] and first not in logger.handlers
        assert logger.level == logging.DEBUG and logger.propagate is False
    finally:
        logger.removeHandler(second)
    with pytest.raises(ValueError, match="ranks='1': choose '0' .* or 'all'"):
        sf.log.setup(ranks="1", name=name)
    with pytest.raises(ValueError, match="style='tqdm': choose"):
        sf.log.progress(3, style="tqdm")
    with pytest.raises(ValueError, match="every=0"):
        sf.log.progress(3, every=0)


def test_progress_lines_every_tenth_and_at_the_end():
    stream = io.StringIO()
    with sf.log.progress(25, "train", stream=stream) as bar:   # StringIO: not a terminal
        for step in range(25):
            bar.update(loss=f"{step:.1f}")
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue() and bar.style == "lines"
    assert [line.split("  ")[0] for line in lines] == \
        [f"train: step {k}/25 ({k / 25:.0%})" for k in (3, 6, 9, 12, 15, 18, 21, 24, 25)]
    assert lines[0].split("  ")[1] == "loss 2.0" and lines[-1].endswith(" s")
    quiet = io.StringIO()
    off = sf.log.progress(25, "train", enabled=False, stream=quiet)
    for _ in range(25):
        off.update(loss="1")
    assert quiet.getvalue() == "" and off.done == 25
    every = io.StringIO()
    unknown = sf.log.progress(None, "read", every=4, stream=every)
    for _ in range(9):
        unknown.update()
    assert [line.split("  ")[0] for line in every.getvalue().splitlines()] == \
        ["read: step 4", "read: step 8"]


def _show(stream, steps: int = 400) -> None:
    bar = sf.log.progress(steps, "long run", stream=stream, mininterval=0)
    for step in range(steps):
        bar.update(loss=f"{1 / (step + 1):.4f}")
    bar.close()
    stream.close()


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:   # a pty's master after its slave closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def test_progress_into_a_pipe_has_no_carriage_return_and_short_lines():
    read, write = os.pipe()
    _show(os.fdopen(write, "w"))          # 400 steps: under the pipe's buffer
    text = _read_all(read).decode()
    assert "\r" not in text, text[:300]
    lines = text.splitlines()
    assert len(lines) == 10 and max(map(len, lines)) < 500, lines
    assert lines[-1].startswith("long run: step 400/400 (100%)  loss 0.0025")


@pytest.mark.skipif(not hasattr(os, "openpty") or sys.platform == "win32", reason="no pty")
def test_progress_on_a_terminal_is_a_tqdm_bar():
    pytest.importorskip("tqdm")
    master, slave = os.openpty()
    _show(os.fdopen(slave, "w"), steps=20)
    text = _read_all(master).decode()
    assert "\r" in text and "long run: 100%" in text, text[-300:]   # redrawn in place
