"""The house's rules (issue 45), read from the source: imports run one way, the ground floor knows
nothing above it, Ray stays in its room, and files stay small enough to read.

A module's *module-level* imports are those that run when it is imported (``if TYPE_CHECKING:``
blocks excluded); imports inside functions run later and cannot close an import circle, and
docs/architecture.md lists the few places that use them to reach back."""

import ast
import pathlib

import steerable

PACKAGE = pathlib.Path(steerable.__file__).parent

# The ground floor: the project's vocabulary, importing nothing above itself.
GROUND = {path.stem for path in PACKAGE.glob("*.py")} | {"selection"}
# Files allowed over 500 lines: GPU kernels, which read best whole.
KERNELS = {"layers/attention_backends/triton_paged.py"}
ROOM_OF_RAY = "ray"
# The floors above the ground (docs/architecture.md#floors): a module imports from its own floor or
# below. Rooms are top-level packages; the dashboards, a tool that drives an engine, sit above sae/.
FLOORS = {"distributed": 1, "structured": 1, "layers": 2, "sae": 3, "steering": 3, "capture": 3, "models": 3,
          "worker": 4, "executor": 4, "engine": 5, "vectors": 6, "sae.dashboards": 6, "entrypoints": 7, "ray": 8}
# Imports inside a function that reach a higher floor: a public call living beside the plane it
# drives hands its work to an engine it builds (LLM) or to Ray, both optional at import time.
REACH_UP = {("steerable.capture.corpus", "steerable.entrypoints.llm"), ("steerable.capture.corpus", "steerable.ray.corpus"),
            ("steerable.capture.replicas", "steerable.entrypoints.llm"),
            ("steerable.entrypoints.cli.dashboards", "steerable.ray.dashboards")}
# Imports inside a function that close a circle of one room: a class's load/save conveniences call
# its format module (which builds the class), the steering parser checks items on its edges.
LAZY_BACK_EDGES = {("steerable.sae.model", "steerable.sae.files"),
                   ("steerable.sae.transcoder", "steerable.sae.transcoder_files"),
                   ("steerable.vectors.control_vector", "steerable.vectors.files"),
                   ("steerable.steering.spec", "steerable.steering.edits"),
                   ("steerable.steering.spec", "steerable.steering.wire")}


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("steerable",) + path.relative_to(PACKAGE).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours an imported name lives in (a module, or a name inside one)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(module: str, module_level_only: bool) -> set[str]:
    """The names ``module`` imports (absolute, relative ones resolved)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def walk(nodes):
        for node in nodes:
            if isinstance(node, ast.If) and _is_type_checking(node):
                continue
            if module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            yield node
            yield from walk(ast.iter_child_nodes(node))

    names = set()
    for node in walk(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.update(f"{base}.{alias.name}" for alias in node.names)
            names.add(base)
    return names


def _module_graph() -> dict[str, set[str]]:
    """Module-level import edges between our modules; a module's own packages are not edges (they
    are imported first by Python anyway, and a package's face only hands names on)."""
    graph = {}
    for module in MODULES:
        targets = {_resolve(name) for name in _imports(module, module_level_only=True) if name.startswith("steerable")}
        graph[module] = {t for t in targets if t and t != module and not module.startswith(t + ".")}
    return graph


def _room(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _floor(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in GROUND:
        return 0
    return FLOORS[".".join(parts[1:3])] if ".".join(parts[1:3]) in FLOORS else FLOORS[parts[1]]


def _edges(module: str, module_level_only: bool) -> set[str]:
    targets = {_resolve(n) for n in _imports(module, module_level_only) if n.startswith("steerable.")}
    return {t for t in targets if t and t != module and not module.startswith(t + ".")}


def test_no_module_level_import_circle():
    graph, state, circles = _module_graph(), {}, []

    def visit(node, trail):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                circles.append(trail[trail.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, trail + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(" -> ".join(c) for c in circles)


def test_the_ground_floor_imports_nothing_above_it():
    offenders = {}
    for module in MODULES:
        if _room(module) not in GROUND:
            continue
        above = {_resolve(n) for n in _imports(module, module_level_only=False) if n.startswith("steerable.")}
        above = {m for m in above if m and _room(m) not in GROUND}
        if above:
            offenders[module] = sorted(above)
    assert not offenders, offenders


def test_only_the_ray_room_imports_ray():
    offenders = [m for m in MODULES if _room(m) != ROOM_OF_RAY
                 and any(n == "ray" or n.startswith("ray.") for n in _imports(m, module_level_only=False))]
    assert not offenders, offenders


def test_files_are_short_and_the_top_level_has_no_scraps():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500 and str(p.relative_to(PACKAGE)) not in KERNELS}
    assert not long, f"files over 500 lines (split them along a seam): {long}"
    scraps = {p.name: n for p in PACKAGE.glob("*.py")
              if (n := len(p.read_text().splitlines())) < 30 and p.name not in ("errors.py", "__init__.py")}
    assert not scraps, f"top-level modules under 30 lines (fold them into the package they serve): {scraps}"


def test_imports_stay_on_their_floor_or_below():
    up = {(m, t) for m in MODULES for t in _edges(m, module_level_only=False) if _floor(t) > _floor(m)}
    module_level = {(m, t) for m, t in up if t in _edges(m, module_level_only=True)}
    assert not module_level, f"module-level imports up a floor: {sorted(module_level)}"
    assert up == REACH_UP, f"function-level imports up a floor, not in REACH_UP (or gone): {sorted(up ^ REACH_UP)}"


def test_circles_closed_inside_functions_are_the_listed_ones():
    graph = _module_graph()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(graph[node])
        return False

    lazy = {(m, t) for m in MODULES for t in _edges(m, False) - _edges(m, True) if reaches(t, m)}
    assert lazy == LAZY_BACK_EDGES, f"import circles closed inside functions, not listed: {sorted(lazy ^ LAZY_BACK_EDGES)}"


def test_every_room_has_a_floor_in_the_docs():
    rooms = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} - GROUND
    assert rooms <= set(FLOORS), f"packages without a floor: {sorted(rooms - set(FLOORS))}"
    docs = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    floors = docs[docs.index("## Floors"):docs.index("\n## ", docs.index("## Floors") + 1)]
    assert all(f"{room.replace('.', '/')}/" in floors for room in FLOORS), "docs/architecture.md#floors misses a room"
