"""The import graph: every module imports on its own; the packages import only downwards (the
command line -> the service, the agent, the trainer -> the library), and the service's layers too
(routers -> domain -> storage); the service's wings (agents, jobs, ingest, ...) import each other
one way only; nothing imports in a circle; the service takes of the library only its light
shared pieces; no import hides inside a function."""

import ast
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("service", "ett", "ett_cli", "agent", "trainer")
# Each package imports only those of a lower tier: the library stands alone, the three programs
# stand on it and never on each other, the command line on all of them.
TIERS = {"ett": 0, "service": 1, "agent": 1, "trainer": 1, "ett_cli": 2}
# What the service may take of the library: pieces without torch, shared with ranks and agents.
LIGHT_LIBRARY = ("ett", "ett.events", "ett.paths", "ett.protocol", "ett.protocol.event_fields", "ett.protocol.messages",
                 "ett.protocol.redaction")  # fmt: skip

# The service's layers, lowest first; a module sits in the first whose prefix it starts with.
LAYERS = (
    ("storage and pure computation", ("service.settings", "service.db", "service.models", "service.states",
                                      "service.model_base", "service.evidence_models", "service.notification_models",
                                      "service.column_types", "service.spec",
                                      "service.outcomes",
                                      "service.migrate",
                                      "service.security", "service.group_commit",
                                      "service.accounting.engine", "service.accounting.report", "service.accounting.fleet",
                                      "service.accounting.fold", "service.accounting.memory", "service.accounting.simulate",
                                      "service.accounting.step_times")),
    # The API's request and response models, above the models: storing a job's spec takes its types
    # from service.spec below, never from here.
    ("schemas", ("service.schemas",)),
    ("domain", ("service.agents", "service.ingest", "service.jobs", "service.accounting", "service.slurm",
                "service.stragglers", "service.failures", "service.webhooks")),
    ("HTTP", ("service.context", "service.api", "service.pages", "service.asgi")),
    ("assembly", ("service.main", "service")),
)  # fmt: skip


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def imports_of(path: Path, name: str) -> tuple[set[str], list[int]]:
    """The project modules `path` imports at its top level, and the lines of imports inside functions."""
    found, nested = set(), []
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        targets = [t for t in targets if t.split(".")[0] in PACKAGES]
        if not targets:
            continue
        if node.col_offset > 0 and not _under_type_checking(tree, node):
            nested.append(node.lineno)
        found.update(targets)
    return found, nested


def _under_type_checking(tree: ast.Module, target: ast.AST) -> bool:
    return any(isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING" and target in ast.walk(n)
               for n in tree.body)  # fmt: skip


def graph() -> dict[str, set[str]]:
    modules = project_modules()
    edges = {}
    for name, path in modules.items():
        targets, _ = imports_of(path, name)
        edges[name] = {t for t in targets if t in modules and t != name}
    return edges


def layer(name: str) -> int:
    return next(i for i, (_, prefixes) in enumerate(LAYERS)
                if any(name == p or name.startswith(p + ".") for p in prefixes))  # fmt: skip


def test_every_module_imports_on_its_own_in_a_fresh_interpreter():
    # One interpreter per module would take a minute; instead one interpreter forgets every
    # project module between imports (third-party ones stay: circles are only among ours).
    names = sorted(project_modules())
    script = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in ("service", "ett", "ett_cli", "agent", "trainer")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\\n".join(failed))
"""
    result = subprocess.run([sys.executable, "-c", script, *names], capture_output=True, text=True, cwd=ROOT,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "", f"modules that fail to import on their own:\n{result.stdout}"


def test_each_package_imports_only_packages_below_it():
    upward = sorted(f"{name} imports {target}" for name, targets in graph().items() for target in targets
                    if target.split(".")[0] != name.split(".")[0]
                    and TIERS[target.split(".")[0]] >= TIERS[name.split(".")[0]])  # fmt: skip
    assert upward == []


# What the library needs of its own (pyproject.toml's torch and pydantic), with their dependencies.
LIBRARY_NEEDS = ("torch", "pydantic")


def distributions_needed(names: tuple[str, ...]) -> set[str]:
    """The installed distributions `names` need, theirs included, extras left out."""
    needed, todo = set(), list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in needed:
            continue
        needed.add(name)
        for line in importlib.metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return needed


def test_the_library_imports_in_an_environment_with_only_torch_and_its_own_needs(tmp_path):
    """A training node's environment need not have the service's packages: a virtual environment
    that holds only torch, pydantic and what they need imports every module of the library (its
    framework integrations need their own extras) and finds no fastapi, sqlalchemy or uvicorn."""
    site = tmp_path / "site"
    site.mkdir()
    for name in distributions_needed(LIBRARY_NEEDS):
        for file in importlib.metadata.distribution(name).files or []:
            top = file.parts[0]
            source = Path(file.locate()).resolve().parents[len(file.parts) - 1] / top
            if not (site / top).exists() and source.exists() and not top.endswith((".dist-info", ".pth")):
                (site / top).symlink_to(source)
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True)
    python = tmp_path / "venv" / "bin" / "python"
    own_site = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                              capture_output=True, text=True).stdout.strip()
    Path(own_site, "only.pth").write_text(f"{site}\n{ROOT}\n")
    library = sorted(name for name in project_modules() if name.split(".")[0] == "ett" and ".integrations" not in name)
    code = ("import importlib, importlib.util, sys\n"
            "for name in sys.argv[1:]: importlib.import_module(name)\n"
            "print([m for m in ('fastapi', 'sqlalchemy', 'uvicorn') if importlib.util.find_spec(m)])")
    result = subprocess.run([python, "-c", code, *library], capture_output=True, text=True, cwd=tmp_path,
                            env={"PATH": "/usr/bin:/bin"}, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[]"


def test_the_services_wings_import_each_other_one_way_only():
    """agents, jobs, ingest, accounting, slurm, ...: an edge between two of them goes one way."""
    wings: dict[str, set[str]] = {}
    for name, targets in graph().items():
        if name.startswith("service.") and name.count(".") >= 2:
            wing = name.split(".")[1]
            wings.setdefault(wing, set()).update(t.split(".")[1] for t in targets
                                                 if t.startswith("service.") and t.count(".") >= 2)  # fmt: skip
    both_ways = sorted(f"{a} <-> {b}" for a in wings for b in wings[a] if a < b and a in wings.get(b, ()))
    assert both_ways == []


def test_the_service_imports_only_downwards_and_nothing_of_the_other_parts():
    upward = []
    for name, targets in graph().items():
        if not name.startswith("service"):
            continue
        for target in targets:
            if target in LIGHT_LIBRARY:  # light pieces shared by ranks, agents and the service
                continue
            assert target.split(".")[0] == "service", f"{name} imports {target}: the service stands on its own"
            if layer(target) > layer(name):
                upward.append(f"{name} ({LAYERS[layer(name)][0]}) imports {target} ({LAYERS[layer(target)][0]})")
    assert upward == []


def test_no_circle_in_the_import_graph():
    edges = graph()
    # Packages import their own modules from __init__ (api collects its routers): an edge from a
    # module to its own package's __init__ is not a circle through it.
    circles, state = [], {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = "open"
        for target in sorted(edges.get(name, ())):
            if name.startswith(target + "."):
                continue
            if state.get(target) == "open":
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            visit(name, [name])
    assert circles == []


@pytest.mark.parametrize("package", ["service", "agent", "ett", "trainer"])
def test_no_import_hides_inside_a_function(package):
    # Imports inside functions dodge circles and hide what a module needs. The command line
    # (ett_cli, agent/cli.py) is the exception: it defers each subcommand's imports, so that
    # `ett --help` or `ett agent` does not load the service, and `ett service` not the agent.
    nested = {}
    for name, path in project_modules().items():
        if name.split(".")[0] == package and name != "agent.cli":
            lines = imports_of(path, name)[1]
            if lines:
                nested[name] = lines
    assert nested == {}


def test_no_file_of_the_service_is_over_300_lines():
    # Small files a newcomer can read at one sitting; a longer one wants splitting by idea.
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "service").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}  # fmt: skip
    assert long == {}


# The agent's rooms (its sub-packages, one concern each), lowest first: a room imports only itself
# and the rooms below it. The agent's top-level modules (the daemon, its command line, its settings,
# the service's client, Slurm's word) stand above every room, and no room imports them.
AGENT_ROOMS = ("agent.files", "agent.node", "agent.confinement", "agent.checkpoints", "agent.warm",
               "agent.launching", "agent.groups", "agent.forwarding")


def agent_room(name: str) -> int:
    room = ".".join(name.split(".")[:2])
    return AGENT_ROOMS.index(room) if room in AGENT_ROOMS else len(AGENT_ROOMS)


def test_the_agents_rooms_import_only_rooms_below_them():
    rooms = {module_name(p) for p in (ROOT / "agent").glob("*/__init__.py")}
    assert rooms == set(AGENT_ROOMS), "each room of the agent is ranked in AGENT_ROOMS"
    upward = sorted(f"{name} imports {target}" for name, targets in graph().items() if name.startswith("agent.")
                    for target in targets if target.startswith("agent.") and agent_room(target) > agent_room(name))
    assert upward == []


def test_each_room_of_the_agent_is_small_and_says_what_it_owns():
    # A room a newcomer takes in at once: at most 15 modules, none over 300 lines, and an __init__.py
    # of one line saying what it owns and nothing else (the guard and each rank runner load it).
    for room in AGENT_ROOMS:
        folder = ROOT / room.replace(".", "/")
        assert 0 < len([p for p in folder.glob("*.py") if p.name != "__init__.py"]) <= 15, room
        tree = ast.parse((folder / "__init__.py").read_text())
        docstring = ast.get_docstring(tree) or ""
        assert len(tree.body) == 1 and docstring and "\n" not in docstring, f"{folder}/__init__.py"
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "agent").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 300}  # fmt: skip
    assert long == {}


def test_no_package_folder_holds_more_than_15_modules():
    """A folder a newcomer takes in at once (#47): the code's packages and the tests' alike. Alembic's
    versions are a chain that grows by one each schema change, read in order, not a room."""
    crowded = {}
    for init in ROOT.glob("*/**/__init__.py"):
        if ".venv" in init.parts or init.parent == ROOT / "migrations" / "versions":
            continue
        modules = [p for p in init.parent.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > 15:
            crowded[str(init.parent.relative_to(ROOT))] = len(modules)
    assert crowded == {}


# The library's rooms and modules, lowest first: each imports only what is at or below its own
# rank. Its public modules (`ett.run`, `ett.checkpoint`, `ett.state`) keep their names.
ETT_ORDER = ("ett.errors", "ett.paths", "ett.elastic", "ett.protocol", "ett.imports", "ett.events", "ett.waits",
             "ett.timing", "ett.state", "ett.checkpoints", "ett.snapshots", "ett.checkpoint", "ett.env", "ett.faults",
             "ett.framework", "ett.run", "ett.integrations")  # fmt: skip
ETT_ROOMS = ("ett.protocol", "ett.checkpoints", "ett.snapshots", "ett.integrations")


def ett_rank(name: str) -> int:
    return next(i for i, p in enumerate(ETT_ORDER) if name == p or name.startswith(p + "."))


def test_the_librarys_rooms_import_only_what_is_below_them():
    modules = {name for name in project_modules() if name.startswith("ett.")}
    assert all(any(m == p or m.startswith(p + ".") for p in ETT_ORDER) for m in modules), "rank each in ETT_ORDER"
    assert {module_name(p) for p in (ROOT / "ett").glob("*/__init__.py")} == set(ETT_ROOMS)
    upward = sorted(f"{name} imports {target}" for name, targets in graph().items() if name.startswith("ett.")
                    for target in targets if target.startswith("ett.") and ett_rank(target) > ett_rank(name))
    assert upward == []
    for room in ETT_ROOMS:
        folder = ROOT / room.replace(".", "/")
        assert 0 < len([p for p in folder.glob("*.py") if p.name != "__init__.py"]) <= 15, room
        assert ast.get_docstring(ast.parse((folder / "__init__.py").read_text())), f"{folder}/__init__.py"
    assert len([p for p in (ROOT / "ett").glob("*.py")]) <= 15


def test_the_agent_daemon_loads_no_torch():
    # A root daemon on every node: torch would cost each agent start about 2.5 s of CPU and 250 MB.
    code = "import sys, agent.daemon, agent.cli; print(*sys.modules)"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert "torch" not in loaded.split()
