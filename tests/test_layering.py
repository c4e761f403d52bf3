"""The import contracts of the whole package, stated once and checked here; and what the light libraries must not load.

Layers, bottom to top (a module may import its own layer and the ones below)::

    0  core: tenplex.core (the worker <-> scheduler protocol included), tenplex.errors, tenplex.sockets,
       tenplex.registry (and the package itself, for __version__)
    1  ptc: the data model
    2  store: tenplex.store (the TensorStore ABC, the local store, the HTTP client, the wire format), tenplex.serving
    3  transformer: the planner and the executor
    4  scheduler
    5  the top: node (the daemon: its app, routes, services and ``tenplex store serve``), worker, k8s, interop,
       launcher, standby, integrations; one does not import another unless listed in SIBLINGS with the reason
    6  entry points: tenplex.cli, tenplex.__main__, tenplex.demo (may import anything)

A package's ``cli`` module is in its package's layer (``tenplex store``'s ``serve`` is the node's command, so the
store's commands need nothing above the store). Every import counts, also one inside a function or under
``TYPE_CHECKING``: a function-local import still points its arrow. There are no circles: none between the
top-level parts of the package, and none between modules (a circle inside one part is listed in KNOWN_CIRCLES
with its reason, and goes away with its fix). The store, the planner/executor, the data model, the ground floor
and the worker library import no web framework (the daemon's routes are ``tenplex.node``'s, the scheduler's
``tenplex.scheduler``'s). Nothing in the product imports ``examples`` or ``tenplex.testing`` (test machinery, not
shipped). A needed exception to the layers is listed in KNOWN with its reason, and goes away with its fix.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

import tenplex

PACKAGE = Path(tenplex.__file__).resolve().parent
ENTRY = 6
LAYERS: dict[str, int] = {
    "tenplex": 0,
    "tenplex.core": 0,
    "tenplex.errors": 0,
    "tenplex.sockets": 0,
    "tenplex.registry": 0,
    "tenplex.ptc": 1,
    "tenplex.store": 2,
    "tenplex.serving": 2,
    "tenplex.transformer": 3,
    "tenplex.scheduler": 4,
    "tenplex.k8s": 5,
    "tenplex.worker": 5,
    "tenplex.node": 5,
    "tenplex.interop": 5,
    "tenplex.launcher": 5,
    "tenplex.standby": 5,
    "tenplex.integrations": 5,
    "tenplex.cli": ENTRY,
    "tenplex.__main__": ENTRY,
    "tenplex.demo": ENTRY,
}
TEST_MACHINERY = ("tenplex.testing", "examples")

SIBLINGS: dict[tuple[str, str], str] = {
    ("tenplex.interop", "tenplex.worker"): "DCP export and import read and write the trainer-state record "
    "(tenplex.worker.trainer_state) that workers store with each version",
    ("tenplex.integrations", "tenplex.worker"): "the trainer integrations (torchtitan's checkpoint manager) are "
    "built on the worker library: register, restore, snapshot, stop, the elastic sample order",
    ("tenplex.launcher", "tenplex.standby"): "`tenplex worker standby` is registered beside `tenplex worker launch` "
    "in the worker command group",
}
KNOWN: dict[tuple[str, str], str] = {}
KNOWN_CIRCLES: dict[frozenset[str], str] = {}
WEB_FREE = ("tenplex.core", "tenplex.errors", "tenplex.ptc", "tenplex.store", "tenplex.transformer", "tenplex.worker")
"""Parts that import no web framework: the daemon's routes are tenplex.node's, the scheduler's its own."""
WEB = ("fastapi", "starlette", "uvicorn")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    for prefix in sorted(LAYERS, key=len, reverse=True):
        if module == prefix or module.startswith(prefix + "."):
            return LAYERS[prefix]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS in {__file__}")


def component(module: str) -> str:
    """The top-level part of the package a module belongs to (``tenplex.store``, ``tenplex.node``)."""
    return ".".join(module.split(".")[:2])


def imports(path: Path, module: str, roots: tuple[str, ...] = ("tenplex", "examples")) -> list[tuple[str, int]]:
    """Every module of the top-level packages ``roots`` imported anywhere in the file, with its line."""
    out = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from tenplex.core import protocol` imports the module tenplex.core.protocol
            names = [f"{target}.{a.name}" for a in node.names]
            out += [(n if any(n == m or m.startswith(n + ".") for m in MODULES) else target, node.lineno) for n in names]
    return [(t, line) for t, line in out if t.split(".")[0] in roots]


FILES = sorted(PACKAGE.rglob("*.py"))
MODULES = {module_name(f) for f in FILES}


def product_graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (a name imported from a module counts as that module)."""
    graph: dict[str, set[str]] = {}
    for path in FILES:
        source = module_name(path)
        if source.startswith(TEST_MACHINERY):
            continue
        targets = graph.setdefault(source, set())
        for target, _line in imports(path, source):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != source and not target.startswith(TEST_MACHINERY):
                targets.add(target)
    return graph


def circles(graph: Mapping[str, Iterable[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one node (Tarjan): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.add(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(frozenset(members))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_points_to_the_same_or_a_lower_layer() -> None:
    problems = []
    used_known = set()
    for path in FILES:
        source = module_name(path)
        testing = source.startswith(TEST_MACHINERY)
        for target, line in imports(path, source):
            where = f"{path.relative_to(PACKAGE.parent)}:{line}: {source} -> {target}"
            key = next(((s, t) for s, t in KNOWN if source == s and (target == t or target.startswith(t + "."))), None)
            if key is not None:
                used_known.add(key)
                continue
            if target.startswith(TEST_MACHINERY):
                if not testing:
                    problems.append(f"{where}: the product imports test machinery or the examples")
                continue
            if testing:
                continue  # test machinery stands on the product
            mine, theirs = layer_of(source), layer_of(target)
            if theirs > mine:
                problems.append(f"{where}: layer {mine} imports layer {theirs}")
            elif theirs == mine == 5 and component(source) != component(target) and (component(source), component(target)) not in SIBLINGS:
                problems.append(f"{where}: {component(source)} and {component(target)} are both at the top; neither imports the other")
    assert problems == [], "imports against the layering:\n" + "\n".join(problems)
    assert used_known == set(KNOWN), f"exceptions no longer needed (remove them from KNOWN): {set(KNOWN) - used_known}"


def test_the_layer_table_covers_every_module() -> None:
    for module in MODULES:
        if not module.startswith(TEST_MACHINERY):
            layer_of(module)


def test_no_circles_between_the_parts_of_the_package() -> None:
    parts: dict[str, set[str]] = {}
    for source, targets in product_graph().items():
        parts.setdefault(component(source), set()).update(
            component(t) for t in targets if component(t) != component(source))
    found = [sorted(c) for c in circles(parts)]
    assert found == [], f"the top-level parts of tenplex import each other in a circle: {found}"


def test_no_circles_between_modules_but_the_known() -> None:
    found = set(circles(product_graph()))
    unknown = [sorted(c) for c in found - set(KNOWN_CIRCLES)]
    assert unknown == [], f"modules importing each other in a circle: {unknown}"
    assert set(KNOWN_CIRCLES) <= found, f"circles no longer there (remove them from KNOWN_CIRCLES): {set(KNOWN_CIRCLES) - found}"


def test_the_web_framework_is_only_the_daemons_and_the_schedulers() -> None:
    problems = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module_name(path)} imports {target}"
        for path in FILES if module_name(path).startswith(WEB_FREE)
        for target, line in imports(path, module_name(path), WEB)
    ]
    assert problems == [], "routes or serving outside tenplex.node and tenplex.scheduler:\n" + "\n".join(problems)


@pytest.mark.parametrize("module", ["tenplex.transformer.plan", "tenplex.transformer.remote", "tenplex.worker"])
def test_light_libraries_load_neither_zarr_nor_the_web_stack(module: str) -> None:
    """The planner, the control plane's transform client and the worker library load neither the local
    store's zarr nor the daemons' FastAPI/uvicorn: a training process or a control plane pays for neither."""
    heavy = ("zarr", "fastapi", "uvicorn", "starlette")
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {heavy!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "", f"importing {module} loaded {out.stdout.strip()}"


def test_the_check_sees_hidden_arrows(tmp_path: Path) -> None:
    """The walker finds a function-local import and resolves `from pkg import module` (it is not blind)."""
    sample = tmp_path / "server.py"
    sample.write_text("def build():\n    from tenplex.k8s.operator import KubernetesScheduler\n"
                      "    return KubernetesScheduler\n")
    found = {t for t, _line in imports(sample, "tenplex.scheduler.server")}
    assert "tenplex.k8s.operator" in found  # inside build()
    worker = {t for t, _line in imports(PACKAGE / "worker" / "control.py", "tenplex.worker.control")}
    assert "tenplex.core.protocol" in worker  # `from tenplex.core import protocol as p`
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
