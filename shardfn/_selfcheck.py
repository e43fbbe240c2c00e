"""``python -m shardfn``: what is installed, what it can run on, and a 2-rank self-check.

The report lists the versions of shardfn, Python, torch and shardfn's runtime
dependencies, the optional packages found (never imported, so it stays fast), the
``torch.distributed`` backends, the devices, and where ``shardfn`` was imported from,
with a warning for an install that a folder named ``shardfn`` could hide. The check
then starts a local world of CPU ranks (gloo) and compares collectives and a small
data-parallel AdamW step with the same function run in this process on the whole
batch; it prints ``PASS`` or ``FAIL`` per check and the exit status says which.

Example:
    ``python -m shardfn`` (report and self-check on 2 ranks), ``python -m shardfn --no-check``
    (the report alone), ``python -m shardfn --world 4``.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch

#: runtime dependencies of shardfn (pyproject.toml's ``dependencies``), by distribution name
REQUIRED = ("torch", "optree", "einops", "cloudpickle", "numpy", "safetensors", "zlib-ng")
#: packages shardfn or its tests use when present (the ``test``/``demo``/``bench`` extras)
OPTIONAL = ("transformers", "tqdm", "rich", "hypothesis", "pytest", "matplotlib", "mkdocs",
            "nbclient", "fairscale")
BACKENDS = ("gloo", "nccl", "mpi", "ucc", "xccl")


class CheckResult(NamedTuple):
    """One self-check: its name, whether it passed, and what was compared (or the error)."""

    name: str
    passed: bool
    detail: str


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    """Versions of shardfn, Python and the runtime dependencies (``"missing"`` if absent).

    Returns:
        ``{name: version}`` in the order of :data:`REQUIRED`, shardfn and python first.
    """
    found = {"shardfn": _version("shardfn") or "not installed (imported from source)",
             "python": platform.python_version()}
    found.update({name: _version(name) or "missing" for name in REQUIRED})
    return found


def optional_packages() -> dict[str, str | None]:
    """``{name: version or None}`` for :data:`OPTIONAL`, read from metadata, not imported."""
    return {name: _version(name) for name in OPTIONAL}


def backends() -> dict[str, bool]:
    """Which ``torch.distributed`` backends this torch build has (``is_<name>_available``)."""
    dist = torch.distributed
    if not dist.is_available():
        return {name: False for name in BACKENDS}
    return {name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
            for name in BACKENDS}


def devices() -> list[str]:
    """One line per device kind: the CPU, each CUDA device by name, and MPS if present."""
    lines = [f"cpu: {torch.get_num_threads()} threads, {platform.machine()}"]
    if torch.cuda.is_available():
        lines += [f"cuda:{i}: {torch.cuda.get_device_name(i)}"
                  for i in range(torch.cuda.device_count())]
    else:
        lines.append("cuda: none")
    mps = getattr(torch.backends, "mps", None)
    lines.append(f"mps: {'available' if mps is not None and mps.is_available() else 'none'}")
    return lines


def install_warnings(paths: Sequence[str] | None = None,
                     hooks: Sequence[str] | None = None) -> list[str]:
    """Why a folder named ``shardfn`` could hide this install, as sentences.

    Python imports a folder without ``__init__.py`` as an empty namespace package when no
    regular ``shardfn`` package is found on ``sys.path``. setuptools' default editable
    install of a flat layout is an import hook searched only after ``sys.path``, so such a
    folder in the working directory or beside a script wins; shardfn's pyproject.toml makes
    ``pip install -e .`` write a path entry instead, and a regular package anywhere on the
    path beats the folder. When the folder wins, ``import shardfn`` runs no code of
    shardfn that could warn (``shardfn.optim`` is simply missing), so this report says it
    beforehand (and :func:`shadowed` explains it when ``python -m shardfn`` runs then).

    Args:
        paths: the search path to inspect (default ``sys.path``).
        hooks: module names of the import hooks (default: those of ``sys.meta_path``).

    Returns:
        Warnings: empty unless shardfn came through setuptools' import hook.

    Example:
        >>> install_warnings()        # a path-entry or regular install
        []
    """
    if hooks is None:
        hooks = [f.__module__ if isinstance(f, type) else type(f).__module__
                 for f in sys.meta_path]
    if not any(name.startswith("__editable___shardfn") for name in hooks):
        return []
    warnings = ["shardfn is installed in editable mode through setuptools' import hook: a "
                "folder named 'shardfn' in the working directory or beside a script is "
                "imported instead, as an empty namespace package. Reinstall with "
                "`pip install -e .` from the checkout (its pyproject.toml makes a path "
                "entry, which wins)."]
    for entry in sys.path if paths is None else paths:
        folder = Path(entry or ".").resolve() / "shardfn"
        if folder.is_dir() and not (folder / "__init__.py").exists():
            warnings.append(f"{folder} (no __init__.py) is on the search path: scripts run "
                            f"there import it instead of shardfn.")
    return warnings


def shadowed() -> str | None:
    """Why ``import shardfn`` gave an empty namespace package, or None if it did not.

    Under setuptools' import-hook editable install, ``python -m shardfn`` still finds this
    module through the hook when the package itself came from a folder named ``shardfn``
    (every attribute of that package is missing): say which folder and what to do.

    Returns:
        The explanation, or None when ``shardfn`` is the regular package.
    """
    package = sys.modules.get("shardfn")
    if package is None or getattr(package, "__file__", None) is not None:
        return None
    folders = ", ".join(str(p) for p in getattr(package, "__path__", []))
    return (f"`import shardfn` imported the folder {folders} (it has no __init__.py) as an "
            f"empty namespace package instead of the installed shardfn at "
            f"{Path(__file__).parent}, so every attribute (shardfn.optim, ...) is missing. "
            f"The editable install is setuptools' import hook, searched after the working "
            f"directory and the script's folder. Run from another directory, rename the "
            f"folder, or reinstall with `pip install -e <checkout>` (shardfn's pyproject.toml "
            f"makes a path entry, which a folder cannot hide).")


# ------------------------------------------------------------------ the distributed checks

def _collectives(world: int) -> dict[str, torch.Tensor]:
    """pmean, psum and all_gather of a value that differs per rank."""
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank() if dist.is_initialized() else 0
    with sf.Mesh({"dp": world}):
        mine = torch.arange(6.0).reshape(2, 3) * (rank + 1) + rank
        return {"pmean": sf.pmean(mine, "dp"), "psum": sf.psum(mine, "dp"),
                "all_gather": sf.all_gather(mine, "dp", dim=0)}


def _collectives_reference(world: int) -> dict[str, torch.Tensor]:
    ranks = [torch.arange(6.0).reshape(2, 3) * (r + 1) + r for r in range(world)]
    return {"pmean": torch.stack(ranks).mean(0), "psum": torch.stack(ranks).sum(0),
            "all_gather": torch.cat(ranks)}


def _train_step(world: int, batch: int, steps: int = 2) -> dict[str, torch.Tensor]:
    """``steps`` AdamW steps of a small MLP on this rank's equal slice of fixed batches of
    ``batch`` rows, gradients averaged by ``sf.data_parallel``; ``world=1`` is the
    one-process reference."""
    import torch.distributed as dist

    import shardfn as sf

    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = sf.Mesh({"dp": world})
    model = sf.functional(torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                              torch.nn.Linear(8, 3)))
    params = model.init(0)
    opt = sf.optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)
    dp = sf.data_parallel(mesh, "dp")

    def loss_fn(params, x, y):
        return ((model.apply(params, x) - y) ** 2).mean()

    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        x, y = torch.randn(batch, 6, generator=gen), torch.randn(batch, 3, generator=gen)
        rows = slice(rank * batch // world, (rank + 1) * batch // world)  # batch % world == 0
        grads = dp.reduce_grads(torch.func.grad(loss_fn)(params, x[rows], y[rows]))
        updates, state = opt.update(grads, state, params)
        params = sf.optim.apply_updates(params, updates)
    return params


def _compare(name: str, per_rank: list[Any], reference: Any) -> CheckResult:
    """Every rank's result equals the reference (``torch.testing.assert_close`` defaults)."""
    try:
        for rank, got in enumerate(per_rank):
            if sorted(got) != sorted(reference):
                raise AssertionError(f"rank {rank} returned {sorted(got)}, "
                                     f"expected {sorted(reference)}")
            for key in reference:
                torch.testing.assert_close(got[key], reference[key],
                                           msg=lambda m, r=rank, k=key: f"rank {r}, {k}: {m}")
    except AssertionError as err:
        return CheckResult(name, False, str(err).strip().splitlines()[0])
    count = sum(torch.as_tensor(v).numel() for v in reference.values())
    ranks = f"{len(per_rank)} rank{'s' if len(per_rank) > 1 else ''}"
    return CheckResult(name, True, f"{ranks} x {count} values equal the one-process result")


def run_checks(world: Any) -> list[CheckResult]:
    """Run the self-checks on ``world`` (anything with ``size`` and ``run(fn, *args)``,
    e.g. a :class:`shardfn.testing.LocalWorld`) and compare with this process.

    Args:
        world: the local world whose ranks run the sharded side.

    Returns:
        One :class:`CheckResult` per check; a check that raises is a failure.
    """
    n = world.size
    checks: list[tuple[str, Callable[[int], Any], Callable[[int], Any]]] = [
        ("collectives (pmean, psum, all_gather)", _collectives, _collectives_reference),
        ("data_parallel AdamW step vs one process",
         functools.partial(_train_step, batch=2 * n), lambda _: _train_step(1, batch=2 * n)),
    ]
    results = []
    for name, on_rank, reference in checks:
        try:
            results.append(_compare(name, world.run(on_rank, n), reference(n)))
        except Exception as err:  # a check that cannot run is a failed check, with why
            lines = [line.strip() for line in str(err).strip().splitlines()] or [""]
            why = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"  # + the cause
            results.append(CheckResult(name, False, f"{type(err).__name__}: {why}"))
    return results


# ------------------------------------------------------------------ the command

def report_lines() -> list[str]:
    """The report's lines: versions, optional packages, backends, devices, install."""
    import shardfn

    lines = ["shardfn self-report"]
    lines += [f"  {name}: {version}" for name, version in versions().items()]
    found = {k: v for k, v in optional_packages().items() if v}
    absent = [k for k, v in optional_packages().items() if not v]
    lines.append("optional: " + (", ".join(f"{k} {v}" for k, v in found.items()) or "none"))
    lines.append("optional, not installed: " + (", ".join(absent) or "none"))
    lines.append("backends: " + ", ".join(f"{k} {'yes' if v else 'no'}"
                                          for k, v in backends().items()))
    lines += ["device " + line for line in devices()]
    lines.append(f"imported from: {Path(shardfn.__file__).parent}")
    lines += [f"WARNING: {w}" for w in install_warnings()]
    return lines


def main(argv: Sequence[str] | None = None, *, open_world: Callable[[int], Any] | None = None
         ) -> int:
    """Print the report, run the self-check on a local world, return the exit status.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``): ``--no-check``, ``--world N``.
        open_world: ``n -> context manager giving a world`` (default
            ``shardfn.testing.local_world``).

    Returns:
        0 if every check passed (or none ran), 1 otherwise.
    """
    parser = argparse.ArgumentParser(prog="python -m shardfn", description=__doc__.split(
        "\n\n")[0])
    parser.add_argument("--no-check", action="store_true", help="print the report only")
    parser.add_argument("--world", type=int, default=2, metavar="N",
                        help="ranks of the local CPU world for the self-check (default 2)")
    args = parser.parse_args(argv)
    why = shadowed()
    if why is not None:
        print(f"FAIL: {why}", file=sys.stderr)
        return 1
    if args.world < 1:
        parser.error(f"--world takes a number of ranks >= 1, got {args.world}")
    print("\n".join(report_lines()), flush=True)
    if args.no_check:
        return 0
    if open_world is None:
        from shardfn.testing import local_world as open_world
    print(f"self-check on a local world of {args.world} CPU ranks (gloo):", flush=True)
    start = time.perf_counter()
    try:
        with open_world(args.world) as world:
            results = run_checks(world)
    except Exception as err:  # the world itself did not start
        results = [CheckResult("start the local world", False,
                               f"{type(err).__name__}: {str(err).strip()[:300]}")]
    for result in results:
        print(f"  {'PASS' if result.passed else 'FAIL'}  {result.name}: {result.detail}")
    ok = all(r.passed for r in results)
    print(f"{'PASS' if ok else 'FAIL'} ({time.perf_counter() - start:.1f} s)", flush=True)
    return 0 if ok else 1
