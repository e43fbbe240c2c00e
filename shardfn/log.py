"""Logs of a multi-rank run: once per job (rank 0) or on every rank with a prefix, and
progress that stays readable when stdout is a file or a pipe.

Built on the standard :mod:`logging` module (named ``shardfn.log`` so that it never
shadows it). Nothing here changes any global state at import: :func:`setup` attaches
one handler to the logger you name (the root logger by default) and returns it, and
calling it again replaces that handler rather than adding a second one.

* :func:`setup` ``(level, ranks="0" | "all", fmt, mesh, name, stream)``: a handler whose
  :class:`RankFilter` passes records on rank 0 only (a log of the job, as Lightning's
  ``rank_zero_info``) or on every rank, each line prefixed ``[rank r/w]`` (or the
  mesh coordinates, ``[dp=1 tp=0]``, when a mesh is given).
* :func:`get_logger` ``(name, mesh)``: a :class:`RankLogger`; as accelerate's
  ``get_logger(...).info(..., main_process_only=True)``, a call with
  ``main_process_only=True`` is logged by rank 0 alone, without a prefix (a line of the
  job, not of a rank). :func:`rank_zero_info` is the one-call form.
* :func:`progress` ``(total, desc)``: a tqdm bar when the stream is a terminal and tqdm is
  installed, else a plain line every ``every`` steps (about every 10%): never a ``\\r``.

tqdm (and rich) stay optional: this module imports tqdm only inside :func:`progress`,
and only when it draws a bar. The rank is ``torch.distributed``'s when a process group
exists, else torchrun's ``RANK`` / ``WORLD_SIZE``, else 0 of 1 (a world of one has no
prefix).

Example:
    >>> import io, shardfn as sf
    >>> out = io.StringIO()
    >>> handler = sf.log.setup(ranks="all", name="example", stream=out)
    >>> log = sf.log.get_logger("example")
    >>> log.info("step %d", 3)                          # every rank; no prefix in a world of one
    >>> log.info("done", main_process_only=True)        # rank 0 only
    >>> out.getvalue()
    'step 3\\ndone\\n'
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from typing import IO, Any, Literal

import torch.distributed as dist

from shardfn.mesh import Mesh

__all__ = ["Progress", "RankFilter", "RankLogger", "get_logger", "progress", "rank_and_world",
           "rank_prefix", "rank_zero_info", "setup"]

#: which ranks a handler passes: ``"0"`` once per job (rank 0), ``"all"`` every rank
Ranks = Literal["0", "all"]
#: how :func:`progress` shows itself: ``"auto"`` a bar on a terminal (tqdm installed), else
#: lines; ``"bar"`` tqdm always; ``"lines"`` plain lines always
ProgressStyle = Literal["auto", "bar", "lines"]

#: the record attributes this module reads (set through ``extra=``)
MAIN_ONLY, MESH = "shardfn_main_process_only", "shardfn_mesh"
#: the default line: the prefix (empty, or ``"[rank 1/4] "``) and the message
DEFAULT_FORMAT = "%(rank_prefix)s%(message)s"


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size.

    Returns:
        ``(rank, world_size)`` from ``torch.distributed`` when a process group exists, else
        from torchrun's ``RANK`` and ``WORLD_SIZE`` (before ``sf.distributed.initialize()``),
        else ``(0, 1)``.

    Example:
        >>> sf.log.rank_and_world()           # plain python, no process group
        (0, 1)
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    except ValueError:   # a malformed launch: sf.distributed.initialize() names it
        return 0, 1


def rank_prefix(mesh: Mesh | None = None) -> str:
    """The tag of this rank's lines.

    Args:
        mesh: when given, the tag is this rank's coordinate on each of its axes.

    Returns:
        ``"[dp=1 tp=0]"`` with a mesh, ``"[rank 1/4]"`` without; ``""`` in a world of one
        (nothing to tell apart).

    Example:
        >>> sf.log.rank_prefix(sf.Mesh({"dp": 1}))    # on a 2 x 2 mesh, rank 2: "[dp=1 tp=0]"
        ''
    """
    rank, world = rank_and_world()
    if world <= 1:
        return ""
    if mesh is not None:
        return "[" + " ".join(f"{axis}={mesh.index(axis)}" for axis in mesh.axis_names) + "]"
    return f"[rank {rank}/{world}]"


def _check_ranks(ranks: str) -> Ranks:
    if ranks not in ("0", "all"):
        raise ValueError(f"ranks={ranks!r}: choose '0' (rank 0 only, once per job) or 'all' "
                         "(every rank, each line prefixed with its rank)")
    return ranks  # type: ignore[return-value]


class RankFilter(logging.Filter):
    """Passes the records of the ranks asked for and gives each a ``rank_prefix``.

    A record logged with ``main_process_only=True`` (:class:`RankLogger`) passes on rank 0
    alone and gets no prefix; so does every record when ``ranks="0"``: those are lines of
    the job, not of a rank. Every other record gets ``"[rank r/w] "`` (or its mesh's
    coordinates, ``"[dp=1 tp=0] "``; the record's own mesh first, else this filter's),
    and ``""`` in a world of one.

    Args:
        ranks: ``"0"`` or ``"all"``.
        mesh: the mesh whose coordinates tag the lines (default: ``[rank r/w]``).

    Example:
        >>> handler = logging.StreamHandler(); handler.addFilter(sf.log.RankFilter("all"))
    """

    def __init__(self, ranks: Ranks = "0", mesh: Mesh | None = None):
        super().__init__()
        self.ranks = _check_ranks(ranks)
        self.mesh = mesh

    def filter(self, record: logging.LogRecord) -> bool:
        rank, _ = rank_and_world()
        once = self.ranks == "0" or bool(getattr(record, MAIN_ONLY, False))
        if once and rank != 0:
            return False
        mesh = getattr(record, MESH, None)
        prefix = "" if once else rank_prefix(self.mesh if mesh is None else mesh)
        record.rank_prefix = prefix + " " if prefix else ""
        return True


class RankLogger(logging.LoggerAdapter):
    """A logger whose calls take ``main_process_only=`` (and ``mesh=``), as accelerate's.

    ``log.info(msg, main_process_only=True)`` is logged on rank 0 only, without a prefix;
    ``log.info(msg, mesh=mesh)`` tags this line with ``mesh``'s coordinates. The filtering
    and the prefix are :class:`RankFilter`'s (installed by :func:`setup`).

    Example:
        >>> log = sf.log.get_logger("train")
        >>> log.info("loss %.3f", 1.25, main_process_only=True)
    """

    def __init__(self, logger: logging.Logger, mesh: Mesh | None = None):
        super().__init__(logger, {})
        self.mesh = mesh

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        extra = dict(kwargs.pop("extra", None) or {})
        extra[MAIN_ONLY] = bool(kwargs.pop("main_process_only", False))
        mesh = kwargs.pop("mesh", None)
        mesh = self.mesh if mesh is None else mesh
        if mesh is not None:
            extra[MESH] = mesh
        kwargs["extra"] = extra
        return msg, kwargs


def get_logger(name: str, mesh: Mesh | None = None) -> RankLogger:
    """The :class:`RankLogger` over ``logging.getLogger(name)``.

    Args:
        name: the logger's name (a module's ``__name__``, or the script's).
        mesh: the mesh whose coordinates tag this logger's per-rank lines.

    Returns:
        A logger adapter: ``.info(msg, *args, main_process_only=False, mesh=None)``.

    Example:
        >>> sf.log.get_logger("train").info("once per job", main_process_only=True)
    """
    return RankLogger(logging.getLogger(name), mesh)


class _RankHandler(logging.StreamHandler):
    """The handler :func:`setup` installs (so that a second call can find and replace it)."""


def setup(level: int | str = "INFO", ranks: Ranks = "0", fmt: str = DEFAULT_FORMAT,
          mesh: Mesh | None = None, name: str | None = None,
          stream: IO[str] | None = None) -> logging.Handler:
    """Log ``name``'s records (the root logger's by default) on the ranks asked for.

    Replaces the handler an earlier call attached to the same logger (never adds a second),
    sets the logger's level and leaves every other logger alone.

    Args:
        level: the logger's level (``"INFO"``, ``logging.DEBUG``, ...).
        ranks: ``"0"``: rank 0 alone (once per job, no prefix); ``"all"``: every rank,
            each line prefixed with its rank (``main_process_only=True`` lines: rank 0).
        fmt: a :mod:`logging` format; ``%(rank_prefix)s`` is the tag with its space.
        mesh: tag the lines with this mesh's coordinates instead of ``[rank r/w]``.
        name: the logger to configure (None: the root logger).
        stream: where lines go (default ``sys.stderr``).

    Returns:
        The handler attached.

    Example:
        >>> _ = sf.log.setup(ranks="all", name="train")    # "[rank 1/4] ..." on every rank
    """
    logger = logging.getLogger(name)
    for old in [h for h in logger.handlers if isinstance(h, _RankHandler)]:
        logger.removeHandler(old)
    handler = _RankHandler(stream)
    handler.addFilter(RankFilter(ranks, mesh))
    handler.setFormatter(logging.Formatter(fmt))
    logger.addHandler(handler)
    logger.setLevel(level)
    if name is not None:
        logger.propagate = False   # not twice through a handler the root logger may have
    return handler


def rank_zero_info(msg: str, *args: Any, logger: str | logging.Logger | None = None) -> None:
    """Log ``msg % args`` at INFO once per job: on rank 0 only, without a prefix.

    Args:
        msg, args: as ``logging.info``'s.
        logger: the logger (or its name) to log to (default: the root logger).

    Example:
        >>> sf.log.rank_zero_info("saved %s", "ckpt/step_50")
    """
    base = logger if isinstance(logger, logging.Logger) else logging.getLogger(logger)
    RankLogger(base).info(msg, *args, main_process_only=True)


# ----------------------------------------------------------------------------- progress


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):   # a closed or odd stream
        return False


def _format_postfix(postfix: Mapping[str, Any]) -> str:
    return "  ".join(f"{key} {value}" for key, value in postfix.items())


class Progress:
    """A progress display: a tqdm bar, or plain lines, or nothing (see :func:`progress`).

    ``update(n=1, **postfix)`` counts ``n`` steps done and shows ``postfix`` (e.g.
    ``loss="2.31"``); ``close()`` ends it (a context manager closes it on exit). The last
    step always prints a line in the ``"lines"`` style.

    Attributes:
        total: the steps expected (None: unknown).
        done: the steps counted so far.
        style: ``"bar"``, ``"lines"`` or ``"off"``.
    """

    def __init__(self, total: int | None, desc: str, style: str, every: int,
                 stream: IO[str], bar: Any = None):
        self.total, self.desc, self.style, self.every = total, desc, style, every
        self.stream, self.bar, self.done = stream, bar, 0
        self._start = time.perf_counter()

    def update(self, n: int = 1, **postfix: Any) -> None:
        """Count ``n`` more steps and show ``postfix`` (keyword -> value to print)."""
        before, self.done = self.done, self.done + n
        if self.bar is not None:
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif self.style == "lines":
            crossed = self.done // self.every > before // self.every
            if crossed or self.done == self.total:
                self.stream.write(self.line(postfix) + "\n")
                self.stream.flush()

    def line(self, postfix: Mapping[str, Any] | None = None) -> str:
        """The plain line of the current step: ``desc: step k/total (p%)  key value  t s``."""
        of = "" if self.total is None else f"/{self.total} ({self.done / self.total:.0%})"
        extra = _format_postfix(postfix or {})
        elapsed = f"{time.perf_counter() - self._start:.1f} s"
        return "  ".join(p for p in (f"{self.desc}: step {self.done}{of}", extra, elapsed) if p)

    def close(self) -> None:
        """End the display (closes the bar)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _tqdm_bar(total: int | None, desc: str, stream: IO[str], **options: Any) -> Any:
    import threading

    try:
        from tqdm import tqdm
    except ImportError as e:
        raise ImportError("progress(style='bar') needs tqdm: pip install tqdm (or shardfn's "
                          "'demo' extra), or use style='lines'") from e
    # a thread lock: tqdm's default also makes a multiprocessing semaphore, which a local
    # world's worker (it exits without interpreter teardown) would leave behind
    tqdm.set_lock(threading.RLock())
    return tqdm(total=total, desc=desc, file=stream, **{"mininterval": 0.25, "ncols": 100,
                                                        **options})


def _tqdm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("tqdm") is not None


def progress(total: int | None, desc: str = "", *, enabled: bool = True,
             style: ProgressStyle = "auto", every: int | None = None,
             stream: IO[str] | None = None, **tqdm_options: Any) -> Progress:
    """A progress display of ``total`` steps that never writes ``\\r`` into a log file.

    Args:
        total: the steps expected (None: unknown).
        desc: what is counted (the start of each line, the bar's label).
        enabled: False: show nothing (``--no-progress``); ``update`` still counts.
        style: ``"auto"``: a tqdm bar when ``stream`` is a terminal and tqdm is installed,
            else lines; ``"bar"``: tqdm (ImportError without it); ``"lines"``: lines.
        every: print a line every this many steps (default: about every 10% of ``total``,
            every 10 steps when it is unknown) and at the last step.
        stream: where to write (default ``sys.stdout``).
        tqdm_options: passed to ``tqdm`` (``unit="step"``, ``ncols=``, ...).

    Returns:
        A :class:`Progress`: ``update(n=1, **postfix)``, ``close()``, a context manager.

    Example:
        >>> with sf.log.progress(3, "train", style="lines", stream=sys.stdout) as bar:
        ...     for step in range(3):
        ...         bar.update(loss=f"{1 / (step + 1):.2f}")   # doctest: +ELLIPSIS
        train: step 1/3 (33%)  loss 1.00  ... s
        train: step 2/3 (67%)  loss 0.50  ... s
        train: step 3/3 (100%)  loss 0.33  ... s
    """
    if style not in ("auto", "bar", "lines"):
        raise ValueError(f"style={style!r}: choose 'auto', 'bar' or 'lines'")
    if every is not None and every < 1:
        raise ValueError(f"every={every}: print a line every 1 or more steps")
    stream = sys.stdout if stream is None else stream
    step = every or (10 if not total else max(1, math.ceil(total / 10)))
    if not enabled:
        return Progress(total, desc, "off", step, stream)
    if style == "bar" or (style == "auto" and _is_terminal(stream) and _tqdm_installed()):
        return Progress(total, desc, "bar", step, stream, _tqdm_bar(total, desc, stream,
                                                                    **tqdm_options))
    return Progress(total, desc, "lines", step, stream)

