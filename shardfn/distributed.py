"""Joining the torch.distributed world a launcher set up (like ``jax.distributed.initialize``).

``torchrun`` starts one process per rank and describes the world in environment
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``) but creates no process group: a script that
never calls ``init_process_group`` runs ``WORLD_SIZE`` separate one-rank
trainings. :func:`initialize` reads that environment and joins the group:

- backend ``"nccl"`` when CUDA is available with at least ``LOCAL_WORLD_SIZE``
  GPUs (each process then owns GPU ``LOCAL_RANK``: ``torch.cuda.set_device``),
  else ``"gloo"`` on CPU;
- without the launcher's variables (a plain ``python script.py``) it does
  nothing: a world of one process needs no process group in shardfn;
- before making the group every rank publishes its ``RANK`` and ``WORLD_SIZE`` on the
  launcher's store: ranks that disagree fail at once naming every value seen, and ranks
  that never come are named after ``join_timeout`` (``init_process_group`` alone waits
  for them forever);
- when a group already exists (a second call, a shardfn local world, a group
  the script made itself) it only checks that the group matches the request
  and the environment, and returns its description.

Example:
    >>> import shardfn as sf
    >>> info = sf.distributed.initialize()   # no-op under plain `python`
    >>> info.world_size, info.backend
    (1, None)
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["DistributedInfo", "JoinError", "LaunchEnv", "initialize", "launch_environment",
           "shutdown"]

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_OURS: dict[str, object] = {}  # set while the default group is one initialize() created
_ATEXIT_REGISTERED = False
DEFAULT_JOIN_TIMEOUT_S = 300.0  # how long initialize() waits for every rank to join
_JOINS = [0]  # initialize() calls that joined a world in this process (a key prefix)


class JoinError(RuntimeError):
    """The launched ranks do not describe one world: they disagree on ``WORLD_SIZE``,
    share a ``RANK``, or some never joined within ``initialize(join_timeout=...)``."""


class LaunchEnv(NamedTuple):
    """The world a launcher (torchrun) describes in the environment."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


class DistributedInfo(NamedTuple):
    """This process's place in the world, as :func:`initialize` leaves it.

    ``backend`` is None for a world of one with no process group; ``device`` is
    where this process's tensors and collectives live (``cuda:LOCAL_RANK`` with
    NCCL, else the CPU).
    """

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    device: torch.device


def launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnv | None:
    """Parse the launcher's environment variables; None when there are none.

    Args:
        environ: the mapping to read (default ``os.environ``).

    Returns:
        A :class:`LaunchEnv`, or None when none of ``RANK``, ``WORLD_SIZE``,
        ``LOCAL_RANK`` is set (a plain ``python script.py``).
        ``LOCAL_WORLD_SIZE`` defaults to ``WORLD_SIZE`` (one node).

    Raises:
        ValueError: when some of the variables are set but others are missing,
            not integers, or out of range (the message names each).

    Example:
        >>> launch_environment({})
        >>> launch_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
        ...                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}).rank
        1
    """
    env = os.environ if environ is None else environ
    present = [name for name in _LAUNCH_VARS if name in env]
    if not present:
        return None
    needed = (*_LAUNCH_VARS, "MASTER_ADDR", "MASTER_PORT")
    missing = [name for name in needed if not env.get(name)]
    if missing:
        given = ", ".join(f"{name}={env[name]}" for name in present)
        raise ValueError(
            f"the environment sets {given} but not {', '.join(missing)}: a launched process "
            f"needs all of {', '.join(needed)} (torchrun sets them; under another launcher set "
            "them yourself, or unset RANK/WORLD_SIZE/LOCAL_RANK to run as a single process)"
        )
    values = {name: _int_var(env, name) for name in (*_LAUNCH_VARS, "MASTER_PORT")}
    local_world_size = _int_var(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else (
        values["WORLD_SIZE"])
    rank, world_size, local_rank = values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} with WORLD_SIZE={world_size}: valid is 0 <= RANK < "
                         "WORLD_SIZE, WORLD_SIZE >= 1")
    if not 1 <= local_world_size <= world_size or not 0 <= local_rank < local_world_size:
        raise ValueError(f"LOCAL_RANK={local_rank} with LOCAL_WORLD_SIZE={local_world_size} and "
                         f"WORLD_SIZE={world_size}: valid is 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE "
                         "<= WORLD_SIZE")
    return LaunchEnv(rank, world_size, local_rank, local_world_size, env["MASTER_ADDR"],
                     values["MASTER_PORT"])


def initialize(
    backend: str | None = None,
    *,
    timeout: float | timedelta | None = None,
    device: torch.device | str | int | None = None,
    join_timeout: float | timedelta = DEFAULT_JOIN_TIMEOUT_S,
) -> DistributedInfo:
    """Join the process group torchrun's environment describes (idempotent).

    Args:
        backend: ``"nccl"``, ``"gloo"``, or None to choose: NCCL when CUDA is
            available with at least ``LOCAL_WORLD_SIZE`` GPUs, else gloo.
        timeout: the process group's timeout (seconds or a timedelta; default
            torch's).
        device: this process's CUDA device under NCCL (default
            ``cuda:LOCAL_RANK``: one GPU per local rank); an error with gloo.
        join_timeout: how long a rank waits for the others to join (seconds or a
            timedelta; default 300). Every rank publishes its ``RANK`` and
            ``WORLD_SIZE`` on the launcher's store first: ranks that disagree on
            ``WORLD_SIZE`` (or share a ``RANK``) fail at once, naming every value
            seen; ranks that never come fail after ``join_timeout``, naming them
            (``init_process_group`` alone would wait for them forever).

    Returns:
        ``DistributedInfo(rank, world_size, local_rank, backend, device)``. With no
        launcher variables and no group it returns ``(0, 1, 0, None, cpu)`` and
        does nothing. With a group already initialised (a second call, inside
        ``sf.testing.local_world``) it checks it and returns its description.

    Raises:
        ValueError: malformed launcher variables (see :func:`launch_environment`),
            an unknown backend, NCCL without CUDA or with too few GPUs, ``device=``
            with gloo, or an existing group that contradicts the request or the
            environment (another backend, rank, world size or device).
        JoinError: the ranks disagree on ``WORLD_SIZE`` or share a ``RANK``, or not
            all of them joined within ``join_timeout``.

    Example:
        >>> info = initialize()   # under `torchrun --nproc-per-node 2 train.py`
        >>> info.world_size, info.backend   # doctest: +SKIP
        (2, 'gloo')
    """
    if backend is not None and backend not in ("nccl", "gloo"):
        raise ValueError(f"backend must be 'nccl', 'gloo' or None (choose), got {backend!r}")
    pg_timeout = _as_timedelta(timeout)
    join_after = _as_timedelta(join_timeout)
    launch = launch_environment()
    if dist.is_initialized():
        return _check_existing(launch, backend, device)
    if launch is None:
        if backend is not None or device is not None:
            asked = f"backend={backend!r}" if backend is not None else f"device={device!r}"
            raise ValueError(
                f"initialize({asked}) outside a launcher: RANK, WORLD_SIZE and "
                "LOCAL_RANK are not set, so this is a world of one process (which needs no "
                "group); launch with torchrun, or call initialize() without arguments"
            )
        return DistributedInfo(0, 1, 0, None, torch.device("cpu"))
    backend = backend or _choose_backend(launch)
    if device is not None and backend != "nccl":
        raise ValueError(f"device={device!r} is for NCCL (one GPU per process); with the "
                         f"{backend!r} backend the process group runs on the CPU: drop "
                         "device=, or pass backend='nccl'")
    cuda_device = _cuda_device(launch, device) if backend == "nccl" else None
    if cuda_device is not None:
        torch.cuda.set_device(cuda_device)
    # the launcher's store, as env:// would make it, but joined with a bound on the wait
    store = join_world(launch, join_after)
    store.set_timeout(pg_timeout or _default_pg_timeout())
    dist.init_process_group(
        backend, store=store, rank=launch.rank, world_size=launch.world_size,
        timeout=pg_timeout, device_id=cuda_device,
    )
    _OURS["group"] = dist.group.WORLD
    _register_atexit()
    return _describe(launch)


def shutdown() -> None:
    """Destroy the process group :func:`initialize` created (no-op otherwise).

    Also runs at interpreter exit. A group made by someone else (a local world,
    the script itself) is left alone. Meshes built before the call are no longer
    usable; build new ones after a fresh :func:`initialize`.

    Example:
        >>> shutdown()   # nothing to do without a group
    """
    group = _OURS.pop("group", None)
    if group is None or not dist.is_initialized() or dist.group.WORLD is not group:
        return
    from shardfn import mesh as _mesh

    _mesh.forget_groups()
    dist.destroy_process_group()


# ---- helpers -------------------------------------------------------------------------------


def _int_var(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} in the environment is not an integer") from None


def _as_timedelta(timeout: float | timedelta | None) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
        raise ValueError(f"timeout must be positive seconds or a timedelta, got {timeout!r}")
    return timedelta(seconds=timeout)


def _default_pg_timeout() -> timedelta:
    from torch.distributed.constants import default_pg_timeout

    return default_pg_timeout


def _choose_backend(launch: LaunchEnv) -> str:
    """NCCL when every local rank can own a GPU, else gloo (the same choice on a node's ranks)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= launch.local_world_size:
        return "nccl"
    return "gloo"


def _cuda_device(launch: LaunchEnv, device: torch.device | str | int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise ValueError("backend 'nccl' needs CUDA, but torch.cuda.is_available() is False; "
                         "use backend='gloo' (or None to choose)")
    if device is None:
        chosen = torch.device("cuda", launch.local_rank)
    else:
        chosen = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    if chosen.type != "cuda":
        raise ValueError(f"device={device!r}: under NCCL each process needs a CUDA device")
    index = launch.local_rank if chosen.index is None else chosen.index
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"LOCAL_RANK={launch.local_rank} needs cuda:{index} but this node has "
            f"{torch.cuda.device_count()} GPUs; start at most that many processes per node "
            "(torchrun --nproc-per-node) or use backend='gloo'"
        )
    return torch.device("cuda", index)


def _describe(launch: LaunchEnv | None) -> DistributedInfo:
    rank = dist.get_rank()
    backend = str(dist.get_backend())
    device = (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl"
              else torch.device("cpu"))
    local_rank = launch.local_rank if launch is not None else rank
    return DistributedInfo(rank, dist.get_world_size(), local_rank, backend, device)


def _check_existing(launch: LaunchEnv | None, backend: str | None,
                    device: torch.device | str | int | None) -> DistributedInfo:
    """A group exists: return its description if it matches the request, else raise."""
    info = _describe(launch)
    problems = []
    if backend is not None and backend != info.backend:
        problems.append(f"backend {backend!r} was asked for but the group uses {info.backend!r}")
    if launch is not None and (launch.rank, launch.world_size) != (info.rank, info.world_size):
        problems.append(f"the environment says RANK={launch.rank}, WORLD_SIZE="
                        f"{launch.world_size} but the group has rank {info.rank} of "
                        f"{info.world_size}")
    if device is not None and info.backend == "nccl":
        wanted = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        if wanted.index is not None and wanted != info.device:
            problems.append(f"device {wanted} was asked for but this process uses {info.device}")
    if problems:
        raise ValueError("torch.distributed is already initialised differently: "
                         + "; ".join(problems))
    return info


def _register_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(shutdown)
        _ATEXIT_REGISTERED = True


# ---- joining: every rank says which world it expects before the group is made --------------


def join_world(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    """Connect to the launcher's store (as ``env://`` does) and agree on the world.

    Every rank publishes ``RANK``/``WORLD_SIZE`` and waits until ``WORLD_SIZE`` ranks
    have, all with its ``WORLD_SIZE`` and distinct ranks.

    Args:
        launch: this rank's launcher environment.
        timeout: the bound on the wait (connecting included).

    Returns:
        The store, to pass to ``init_process_group(store=...)``.

    Raises:
        JoinError: a disagreement (at once, naming every rank's values) or ranks that
            did not join within ``timeout`` (naming those that did).
    """
    deadline = time.monotonic() + timeout.total_seconds()
    try:
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True):  # torchrun's agent
            store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                                  is_master=False, timeout=timeout)
        else:  # rank 0 hosts it; it does not wait for the others here (we do, below)
            store = dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                                  is_master=launch.rank == 0, timeout=timeout,
                                  wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, TimeoutError) as e:  # DistStoreError/DistNetworkError subclass these
        raise JoinError(
            f"rank {launch.rank} (WORLD_SIZE={launch.world_size}) could not reach the "
            f"rendezvous store at {launch.master_addr}:{launch.master_port} within "
            f"{timeout.total_seconds():g} s: is rank 0 running with the same MASTER_ADDR/"
            f"MASTER_PORT? ({e})") from e
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"shardfn/join/{restart}/{_JOINS[0]}"
    _JOINS[0] += 1
    seen: dict[int, tuple[int, int]] = {}  # join index -> (RANK, WORLD_SIZE)
    try:
        index = store.add(f"{prefix}/count", 1)
        store.set(f"{prefix}/{index}", f"{launch.rank} {launch.world_size}")
        while True:
            count = store.add(f"{prefix}/count", 0)
            for i in range(1, count + 1):
                if i not in seen and store.check([f"{prefix}/{i}"]):
                    rank, size = store.get(f"{prefix}/{i}").decode().split()
                    seen[i] = (int(rank), int(size))
            problem = _disagreement(launch, sorted(seen.values()), count)
            if problem:
                raise JoinError(problem)
            if count == len(seen) == launch.world_size:
                return store
            if time.monotonic() > deadline:
                raise JoinError(_missing(launch, sorted(seen.values()), timeout))
            time.sleep(0.02)
    except JoinError:
        raise
    except (RuntimeError, TimeoutError) as e:  # the host of the store left (rank 0 failed)
        joined = sorted(seen.values())
        missing = sorted(set(range(launch.world_size)) - {rank for rank, _ in joined})
        raise JoinError(
            f"rank {launch.rank} (WORLD_SIZE={launch.world_size}) lost the rendezvous store "
            f"at {launch.master_addr}:{launch.master_port} while the ranks joined (rank 0 "
            f"hosts it: its error says why it left); seen so far: {_values(joined)}; never "
            f"joined: RANK {missing}") from e


def _values(seen: list[tuple[int, int]]) -> str:
    return ", ".join(f"RANK={rank} WORLD_SIZE={size}" for rank, size in seen)


def _disagreement(launch: LaunchEnv, seen: list[tuple[int, int]], count: int) -> str | None:
    """Why the ranks seen so far cannot form this rank's world, or None."""
    sizes = sorted({size for _, size in seen})
    ranks = [rank for rank, _ in seen]
    if len(sizes) > 1:
        return (f"the launched processes disagree on WORLD_SIZE: seen {_values(seen)} "
                f"(this is RANK={launch.rank}); every process of one job needs the same "
                f"WORLD_SIZE (torchrun sets it; check what the script or launcher changes)")
    duplicates = sorted({rank for rank in ranks if ranks.count(rank) > 1})
    if duplicates or count > launch.world_size:
        return (f"more processes joined than WORLD_SIZE={launch.world_size} allows, or two "
                f"share a RANK (RANK {duplicates}): seen {_values(seen)}; every process "
                f"needs its own RANK in 0..WORLD_SIZE-1")
    return None


def _missing(launch: LaunchEnv, seen: list[tuple[int, int]], timeout: timedelta) -> str:
    missing = sorted(set(range(launch.world_size)) - {rank for rank, _ in seen})
    return (f"only {len(seen)} of WORLD_SIZE={launch.world_size} processes joined within "
            f"{timeout.total_seconds():g} s (initialize(join_timeout=...)); seen "
            f"{_values(seen)}; never joined: RANK {missing}. Start every rank, with the same "
            f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT")
