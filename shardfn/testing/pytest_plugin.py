"""shardfn's pytest plugin: shared local worlds, ``@pytest.mark.world(n)``, hypothesis profiles.

Installed with shardfn (entry point ``pytest11: shardfn``), or loaded with
``-p shardfn.testing.pytest_plugin`` / ``pytest_plugins = ["shardfn.testing.pytest_plugin"]``.

* ``local_world`` (session fixture): ``local_world(n)`` is the session's
  ``LocalWorld`` of ``n`` ranks, started on first use and reused by every test
  and hypothesis example (the same worlds ``assert_sharded_matches`` uses);
  they close at the end of the session.
* ``@pytest.mark.world(n)``: the test body runs on the ``n`` ranks of that
  world (shipped by cloudpickle; its arguments, fixtures and hypothesis draws
  included, must pickle). A failure names the rank and carries its traceback.
  Under ``@given`` each example runs on the ranks; shrinking works as usual.
* hypothesis profiles ``"shardfn-ci"`` (10 examples, derandomized, no deadline)
  and ``"shardfn-dev"`` (25 examples, no deadline); select one with
  ``--hypothesis-profile=shardfn-ci``. :func:`examples_for` scales the count down
  for large worlds.

Example:
    >>> @pytest.mark.world(2)
    ... def test_psum():
    ...     import shardfn as sf
    ...     with sf.Mesh({"dp": 2}):
    ...         assert sf.psum(torch.ones(()), "dp") == 2
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest

__all__ = ["PROFILES", "examples_for", "local_world"]

# Installed as an entry point, this module is imported by every pytest run in the
# environment (with shardfn and torch, its parents): it must not need hypothesis, a
# test dependency, and imports the local world only when a test uses one.
PROFILES = {
    "shardfn-ci": dict(max_examples=10, deadline=None, derandomize=True, print_blob=True),
    "shardfn-dev": dict(max_examples=25, deadline=None),
}


def _register_profiles() -> None:
    try:
        from hypothesis import settings
    except ImportError:  # hypothesis is a test dependency: no profiles without it
        return
    for name, options in PROFILES.items():
        settings.register_profile(name, **options)


_register_profiles()


def examples_for(n_ranks: int, base: int | None = None) -> int:
    """Examples for a property test on ``n_ranks`` ranks: the profile's count, halved per doubling.

    Args:
        n_ranks: the world size of the test.
        base: the count for one or two ranks (default: the current profile's max_examples).

    Returns:
        ``max(2, base * 2 // n_ranks)`` for ``n_ranks > 2``, else ``base``.

    Example:
        >>> @settings(max_examples=examples_for(4))
    """
    from hypothesis import settings

    base = settings().max_examples if base is None else base
    return base if n_ranks <= 2 else max(2, base * 2 // n_ranks)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "world(n): run the test body on the n ranks of the session's local world "
        "(shardfn.testing.pytest_plugin)")


def pytest_unconfigure(config: pytest.Config) -> None:
    import sys

    worlds = sys.modules.get("shardfn.testing.worlds")
    if worlds is not None:  # worlds were possibly started: end them
        worlds.close_all()


@pytest.fixture(scope="session")
def local_world() -> Iterator[Callable[[int], Any]]:
    """``local_world(n)``: the session's ``LocalWorld`` of ``n`` ranks (started on first use).

    Example:
        >>> def test_sum(local_world):
        ...     assert local_world(2).run(lambda: 1) == [1, 1]
    """
    from shardfn.testing import worlds

    yield worlds.shared_world
    worlds.close_all()


class RankFailure(AssertionError):
    """A ``@pytest.mark.world(n)`` test body failed on a rank (``rank``; the message has its
    traceback)."""

    def __init__(self, rank: int, message: str):
        super().__init__(message)
        self.rank = rank


def _world_size(item: pytest.Function) -> int | None:
    marker = item.get_closest_marker("world")
    if marker is None:
        return None
    size = marker.args[0] if marker.args else marker.kwargs.get("n")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.world takes the number of ranks, "
                                f"an int >= 1, got {size!r}")
    return size


def _by_value(fn: Callable) -> Callable:
    """A copy of ``fn`` that cloudpickle ships by value (the ranks need not import its module)."""
    if not isinstance(fn, types.FunctionType):
        return fn
    copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__module__ = fn.__module__  # the module's attribute is ``fn``, not this copy
    return copy


def _on_ranks(fn: Callable, size: int, name: str) -> Callable:
    """``fn`` run on every rank of the shared world of ``size`` (same arguments on each)."""
    body = _by_value(fn)

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        import cloudpickle

        from shardfn.testing.local_world import RankError
        from shardfn.testing.worlds import shared_world

        for arg, value in kwargs.items():
            try:
                cloudpickle.dumps(value)
            except Exception as err:  # a LocalWorld, an open file ...: say which argument
                raise TypeError(f"{name}: @pytest.mark.world ships the test's arguments to the "
                                f"ranks, but {arg!r} ({type(value).__name__}) cannot be "
                                f"pickled: {err}") from None
        try:
            shared_world(size).run(body, *args, **kwargs)
        except RankError as err:
            raise RankFailure(err.rank, f"{name} failed on rank {err.rank} of {size}:\n"
                              f"{err.remote_traceback}") from None

    return run


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    size = _world_size(pyfuncitem)
    if size is None:
        return None
    test = pyfuncitem.obj
    kwargs = {arg: pyfuncitem.funcargs[arg] for arg in pyfuncitem._fixtureinfo.argnames}
    hypothesis = getattr(test, "hypothesis", None)
    if hypothesis is None:
        _on_ranks(test, size, pyfuncitem.name)(**kwargs)
        return True
    inner = hypothesis.inner_test  # @given: every example's body goes to the ranks
    hypothesis.inner_test = _on_ranks(inner, size, pyfuncitem.name)
    try:
        test(**kwargs)
    finally:
        hypothesis.inner_test = inner
    return True
