"""The shape of the package: limits that keep shardfn readable, checked on its source.

Each test reads the files under ``shardfn/`` as text (nothing is imported) and
prints every offender with its place, so a failure says what to fix:

* no import cycle among shardfn's modules (imports inside functions count, those
  under ``if TYPE_CHECKING:`` do not; dynamic ``importlib`` imports are not seen);
* imports go one way: down :data:`LAYERS`, and down :data:`SHARD_PARAMS_ORDER`
  inside the shard_params package;
* no private torch name outside ``shardfn/_torch_internals.py``;
* no file over :data:`MAX_LINES` lines;
* no block of :data:`MIN_BLOCK` or more lines repeated inside the shard_params
  package, neither letter for letter nor in shape (the same lines with other
  names, strings and numbers).
"""

from __future__ import annotations

import ast
import io
import keyword
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shardfn"
INTERNALS = PACKAGE / "_torch_internals.py"
MAX_LINES = 450
MIN_BLOCK = 6


def _module_files() -> dict[str, Path]:
    """``{"shardfn.a.b": path}`` for every module; a package shadows a same-named ``.py``."""
    modules: dict[str, Path] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if parts[-1] != "__init__" and (path.with_suffix("") / "__init__.py").exists():
            continue  # python imports the package shardfn/x/ before shardfn/x.py
        modules[name] = path
    return modules


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# --- import cycles ---------------------------------------------------------------------


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement, at top level or inside functions and classes, except those
    under ``if TYPE_CHECKING:`` (they never run)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                yield from _imports(ast.Module(body=[child], type_ignores=[]))
            continue
        yield from _imports(node)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool,
             modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """The shardfn modules an import statement runs, each with the statement's line.

    ``from shardfn.x import y`` is an import of ``shardfn.x.y`` when that is a module,
    else of ``shardfn.x`` (its ``__init__``); the parent packages a dotted import runs
    first are not counted (``shardfn/__init__.py`` imports its submodules: that is not
    a cycle unless one of them takes a name from the package itself).
    """
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name in modules:
                yield alias.name, node.lineno
        return
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source not in modules:
        return
    for alias in node.names:
        sub = f"{source}.{alias.name}"
        yield (sub if sub in modules else source), node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    """``{module: {imported module: line of the first such import}}`` within shardfn."""
    modules = _module_files()
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        tree = ast.parse(path.read_text(), str(path))
        for node in _imports(tree):
            for target, line in _targets(node, name, path.name == "__init__.py", modules):
                if target != name:
                    edges.setdefault(target, line)
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (as a closed path of modules) per strongly connected component with a loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; shardfn's graph is small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_through(graph, set(c), c[0]) for c in components]


def _cycle_through(graph: dict[str, dict[str, int]], members: set[str], start: str) -> list[str]:
    """A shortest path start -> ... -> start inside one strongly connected component."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in members:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # unreachable for a component


def test_cycle_finder_finds_a_cycle():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3, "d": 4}, "d": {}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b": 1}, "b": {}}) == []


def test_import_targets_resolve_relative_and_package_imports():
    modules = {m: Path() for m in ("shardfn", "shardfn.mesh", "shardfn.primitives",
                                   "shardfn.primitives.stats", "shardfn.primitives.flat")}
    source = ("from . import stats\nfrom ..mesh import Mesh\nimport shardfn.mesh\n"
              "from shardfn import primitives, Mesh\nfrom shardfn.primitives import flat\n"
              "def f():\n    from shardfn.primitives.stats import x\n"
              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import shardfn\n")
    found = [t for node in _imports(ast.parse(source))
             for t, _ in _targets(node, "shardfn.primitives.flat", False, modules)]
    assert found == ["shardfn.primitives.stats", "shardfn.mesh", "shardfn.mesh",
                     "shardfn.primitives", "shardfn", "shardfn.primitives.flat",
                     "shardfn.primitives.stats"]


def test_no_import_cycles():
    """Imports inside functions count (a function-level import that hides a cycle is still
    one); imports under ``if TYPE_CHECKING:`` do not."""
    graph = import_graph()
    modules = _module_files()
    cycles = find_cycles(graph)
    lines = []
    for cycle in cycles:
        lines.append("cycle: " + " -> ".join(cycle))
        for a, b in zip(cycle, cycle[1:], strict=False):
            lines.append(f"  {_rel(modules[a])}:{graph[a][b]} imports {b}")
    assert not cycles, "import cycles among shardfn's modules:\n" + "\n".join(lines)


#: shardfn's layers, lowest first: a module imports only from its own layer or lower ones
#: (a name covers that module and its submodules; ``shardfn`` alone is the package's
#: ``__init__``, the public API on top)
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundations", ("shardfn._torch_internals", "shardfn.pytree", "shardfn.mesh",
                     "shardfn.log", "shardfn.overlap")),
    ("collectives", ("shardfn.primitives", "shardfn.distributed")),
    ("specs", ("shardfn.spec",)),
    ("models and memory", ("shardfn.functional", "shardfn._functional_init", "shardfn.models",
                           "shardfn._functional_leaves", "shardfn._functional_swap",
                           "shardfn.memory", "shardfn.model",
                           "shardfn._functional_layout", "shardfn._functional_hf",
                           "shardfn._functional_grad")),
    ("optimizers", ("shardfn.optim",)),
    ("transforms", ("shardfn.transforms",)),
    ("checkpoints", ("shardfn.checkpoint",)),
    ("data", ("shardfn.data",)),
    ("public API and test worlds", ("shardfn", "shardfn.testing", "shardfn._selfcheck",
                                    "shardfn.__main__")),
)


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of the longest name that covers ``module`` (None: none)."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or (prefix != "shardfn" and module.startswith(prefix + ".")):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def test_layer_of():
    assert layer_of("shardfn._torch_internals") == 0
    assert layer_of("shardfn.primitives.flat") == 1 < layer_of("shardfn.transforms.remat") == 5
    assert layer_of("shardfn") == layer_of("shardfn.testing.local_world") == len(LAYERS) - 1
    assert layer_of("shardfn.new_module") is None


def test_layers_import_only_downwards():
    """Nothing lower in shardfn imports anything higher (the cycle test cannot see a layer
    reaching up without a loop back); a new top-level module must be given a layer."""
    graph, modules = import_graph(), _module_files()
    unplaced = sorted(m for m in graph if layer_of(m) is None)
    assert not unplaced, f"modules with no layer in LAYERS: {unplaced}"
    upward = [f"  {_rel(modules[a])}:{line} ({LAYERS[layer_of(a)][0]}) imports {b} "
              f"({LAYERS[layer_of(b)][0]})"
              for a, edges in sorted(graph.items()) for b, line in sorted(edges.items())
              if layer_of(b) > layer_of(a)]
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


#: the shard_params package's modules in the order its docstring gives: each imports only
#: modules before it (placement/choose, plan, exchange, the call's parts, api)
SHARD_PARAMS_ORDER = ("placement", "choose", "plan", "exchange", "tree", "unit_modes",
                      "accumulator", "prefetch", "deferred", "record", "steps", "forward",
                      "backward", "functions", "call", "compose", "leaves", "compiled", "api")


def test_shard_params_layers_import_only_downwards():
    """plan <- exchange <- call <- api: nothing lower in the package imports anything
    higher (the package's ``__init__`` re-exports from any of them)."""
    package = "shardfn.transforms.shard_params"
    graph, modules = import_graph(), _module_files()
    if package not in graph or modules[package].name != "__init__.py":
        return  # not a package yet: test_no_import_cycles covers its files
    inside = sorted(m.removeprefix(package + ".") for m in graph if m.startswith(package + "."))
    unplaced = [m for m in inside if m not in SHARD_PARAMS_ORDER]
    assert not unplaced, f"shard_params modules with no place in SHARD_PARAMS_ORDER: {unplaced}"
    upward = []
    for name in inside:
        for target, line in sorted(graph[f"{package}.{name}"].items()):
            other = target.removeprefix(package + ".")
            if other in SHARD_PARAMS_ORDER and \
                    SHARD_PARAMS_ORDER.index(other) > SHARD_PARAMS_ORDER.index(name):
                upward.append(f"  {_rel(modules[package + '.' + name])}:{line} imports {other}")
    assert not upward, "shard_params: a lower module imports a higher one:\n" + "\n".join(upward)


# --- private torch names ---------------------------------------------------------------

#: ``torch.<...>._x`` (any private attribute or module under torch), ``torch.ops.inductor``
PRIVATE_ATTRIBUTE = re.compile(r"\btorch\.(?:[A-Za-z_][A-Za-z0-9_]*\.)*_[A-Za-z]"
                               r"|\btorch\.ops\.inductor\b")
#: ``from torch.x import _y`` / ``from torch.x._y import z``
PRIVATE_FROM = re.compile(r"\bfrom\s+torch(?:\.\w+)*\s+import\b[^#\n]*?(?<![\w.])_[A-Za-z]"
                          r"|\bfrom\s+torch(?:\.\w+)*\._\w")
#: private torch names that are recognisable without the ``torch.`` before them
PRIVATE_NAMES = re.compile(r"(?<![A-Za-z0-9])(?:distributed_c10d|_c10d_functional|_functorch"
                           r"|_python_dispatch|_pytree|_DisableFuncTorch|_dynamo|_subclasses"
                           r"|_inductor|_get_default_store|_get_sequence_number_for_group"
                           r"|pg_map)(?![A-Za-z0-9])")
#: documented, if underscored: the foreach kernels (torch.optim's own fast path), listed
#: under "Foreach Operations" in torch's reference
ALLOWED = re.compile(r"\btorch\._foreach_")


def private_torch_mentions(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of each line of ``text`` that names a private torch name."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        rest = ALLOWED.sub("torch.foreach_", line)
        if PRIVATE_ATTRIBUTE.search(rest) or PRIVATE_FROM.search(rest) or \
                PRIVATE_NAMES.search(rest):
            found.append((number, line.strip()))
    return found


def _multiline_private_from(tree: ast.AST) -> Iterator[tuple[int, str]]:
    """``from torch.x import (\\n _y)`` over several lines: the regex sees one line at a time."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    yield node.lineno, f"from {node.module} import {alias.name}"


def test_private_name_patterns():
    hits = [
        "x = torch._C._functorch.get_unwrapped(x)", "import torch._dynamo",
        "from torch.utils._pytree import tree_flatten", "from torch.nn.modules.batchnorm import _B",
        "op = torch.ops.inductor.resize_storage_bytes_", "ops = torch.ops._c10d_functional",
        "# calls the _c10d_functional ops", "store = distributed_c10d.get()",
        "from torch.distributed import distributed_c10d", "torch.Tensor._base",
    ]
    misses = ["torch.ops.aten.add", "torch._foreach_add_(xs, ys)", "``torch._foreach_*`` kernels",
              "torch.utils.checkpoint", "from torch.utils.checkpoint import checkpoint",
              "self._functorchy = 1",
              "my_pytree = 2", "from shardfn import _torch_internals as ti"]
    assert [n for n, _ in private_torch_mentions("\n".join(hits))] == list(range(1, 11))
    assert private_torch_mentions("\n".join(misses)) == []


def test_no_private_torch_names_outside_internals():
    """Source text, comments and docstrings included: the one module that may name torch's
    internals is ``shardfn/_torch_internals.py``."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == INTERNALS:
            continue
        text = path.read_text()
        found = dict(private_torch_mentions(text))
        found.update(_multiline_private_from(ast.parse(text, str(path))))
        offenders += [f"{_rel(path)}:{n}: {line}" for n, line in sorted(found.items())]
    assert not offenders, ("private torch names outside shardfn/_torch_internals.py (import "
                           "them from there, or add them there):\n" + "\n".join(offenders))


# --- file size -------------------------------------------------------------------------


def test_no_file_over_the_line_limit():
    sizes = {path: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    over = [f"{_rel(p)}: {n} lines" for p, n in sorted(sizes.items()) if n > MAX_LINES]
    assert not over, f"files in shardfn/ over {MAX_LINES} lines:\n" + "\n".join(over)


# --- repeated blocks in shard_params ---------------------------------------------------


class Line(NamedTuple):
    """One line that counts: where it is, its text (white space stripped) and its shape."""

    path: Path
    number: int
    text: str
    shape: str


_SKIPPED = re.compile(r"[\s()\[\]{},:;]*")  # blank or lone punctuation
_THIN = re.compile(r"[\sNS0()\[\]{},:;.=*]*")  # a shape of only names, values and punctuation


def shard_params_files() -> list[Path]:
    """The shard_params package's files, or, before it exists, the files it is made from."""
    package = PACKAGE / "transforms" / "shard_params"
    if (package / "__init__.py").exists():
        return sorted(package.rglob("*.py"))
    transforms = PACKAGE / "transforms"
    return sorted([transforms / "shard_params.py", *transforms.glob("_unit_*.py"),
                   *transforms.glob("_units.py")])


_FSTRING_TOKENS = {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE",
                                                  "FSTRING_END") if hasattr(tokenize, n)}


def _shape(text: str) -> str:
    """The line with every name (not keywords) as ``N``, string as ``S`` and number as ``0``."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.NAME:
                out.append(tok.string if keyword.iskeyword(tok.string) else "N")
            elif tok.type == tokenize.STRING or tok.type in _FSTRING_TOKENS:
                if not out or out[-1] != "S":
                    out.append("S")
            elif tok.type == tokenize.NUMBER:
                out.append("0")
            elif tok.type == tokenize.OP:
                out.append(tok.string)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return text  # a line that does not tokenize alone (inside a string): compare as is
    return " ".join(out)


def _passed_over(tree: ast.AST) -> set[int]:
    """The line numbers of imports, docstrings and other bare string statements (prose)."""
    lines = set()
    for node in ast.walk(tree):
        prose = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and \
            isinstance(node.value.value, str)
        if prose or isinstance(node, (ast.Import, ast.ImportFrom)):
            lines.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return lines


def counted_lines(path: Path) -> list[Line]:
    """The lines that count: code, not blank lines, comments, docstrings, lone punctuation
    or imports."""
    text_of_file = path.read_text()
    skipped = _passed_over(ast.parse(text_of_file, str(path)))
    lines = []
    for number, raw in enumerate(text_of_file.splitlines(), 1):
        text = " ".join(raw.split())
        if not text or text.startswith("#") or _SKIPPED.fullmatch(text) or number in skipped:
            continue
        lines.append(Line(path, number, text, _shape(text)))
    return lines


def repeated_blocks(files: list[Path], *, by_shape: bool,
                    size: int = MIN_BLOCK) -> list[tuple[Line, Line]]:
    """Pairs of places whose next ``size`` counted lines are equal (or equal in shape).

    Overlapping places in one file are not a repeat; for shapes, a block made only of
    names, values and punctuation (``N = N(N, N)``, a list of fields) is too thin to
    mean the code is written twice and is passed over.
    """
    seen: dict[tuple[str, ...], tuple[Line, int]] = {}  # block -> first place, its index
    pairs: list[tuple[Line, Line]] = []
    for path in files:
        lines = counted_lines(path)
        previous: tuple[Path, int] | None = None  # where the last repeated block came from
        for i in range(len(lines) - size + 1):
            key = tuple(line.shape if by_shape else line.text for line in lines[i:i + size])
            if by_shape and sum(not _THIN.fullmatch(s) for s in key) < size // 2:
                previous = None
                continue
            first, j = seen.setdefault(key, (lines[i], i))
            if first.path == path and i - j < size:  # itself, or overlapping itself
                previous = None
                continue
            if previous != (first.path, j - 1):  # not the same run one line further on
                pairs.append((first, lines[i]))
            previous = (first.path, j)
    return pairs


def test_repeated_blocks_are_found():
    import tempfile

    body = "\n".join(f"    total_{i} = compute(value_{i}, {i})\n    if total_{i} > 0:\n"
                     f"        emit(total_{i}.item())" for i in range(2))
    with tempfile.TemporaryDirectory() as tmp:
        a, b = Path(tmp) / "a.py", Path(tmp) / "b.py"
        a.write_text(f"def f():\n{body}\n    return 1\n")
        b.write_text(f"def g():\n{body}\n    return 2\n")
        assert len(repeated_blocks([a, b], by_shape=False)) == 1
        b.write_text(f"def g():\n{body.replace('total', 'sum').replace('emit', 'log')}\n")
        assert repeated_blocks([a, b], by_shape=False) == []
        assert len(repeated_blocks([a, b], by_shape=True)) == 1


def _describe(pairs: list[tuple[Line, Line]]) -> list[str]:
    return [f"  {_rel(a.path)}:{a.number} ~ {_rel(b.path)}:{b.number}: {a.text!r}"
            for a, b in pairs]


def test_no_repeated_blocks_in_shard_params():
    """Six or more counted lines (blank lines, comments, docstrings, lone punctuation and
    imports are passed over; white space is folded) must not stand twice in the shard_params
    package,
    neither as the same text nor as the same shape with other names, strings and numbers."""
    files = shard_params_files()
    same = repeated_blocks(files, by_shape=False)
    shape = repeated_blocks(files, by_shape=True)
    assert not same and not shape, "\n".join([
        f"blocks of {MIN_BLOCK}+ lines repeated in the shard_params package:",
        *_describe(same), "same shape with other names:", *_describe(shape)])


# ------------------------------------------------------------------ the model protocol seam

def _model_kinds() -> list[str]:
    """``module.Class`` of every class in the package that defines ``apply``: a model
    kind, which must implement the whole protocol (itself or through a base such as
    ``shardfn.model.WrapsModel``)."""
    kinds = []
    for module, path in _module_files().items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                defined = {item.name for item in node.body
                           if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))}
                if "apply" in defined and node.name != "Model":
                    kinds.append(f"{module}.{node.name}")
    return kinds


def test_every_model_kind_implements_the_whole_protocol():
    """A class with ``init`` and ``apply`` is a model kind: it has every member of
    ``shardfn.model.MEMBERS`` (as a method, property or dataclass field), so a new kind
    cannot ship half the protocol (what the members do: tests/test_model_conformance.py)."""
    import dataclasses
    import importlib

    from shardfn.model import MEMBERS

    kinds = _model_kinds()
    assert len(kinds) >= 7, kinds  # functional, sharded, split, FSDP x TP, pipeline, ...
    lacking = {}
    for kind in kinds:
        module, name = kind.rsplit(".", 1)
        cls = getattr(importlib.import_module(module), name)
        fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) \
            else set()
        missing = [m for m in MEMBERS if not hasattr(cls, m) and m not in fields]
        if missing:
            lacking[kind] = missing
    assert not lacking, f"model kinds lacking protocol members: {lacking}"
