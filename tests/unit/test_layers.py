"""The layers as the code has them: what a trainer's import loads, what tierps.core may
import, that the `tierps` commands which run shards name the `server` extra when it is
missing, and that no tierps module depends on itself through others.

The import checks run in fresh interpreters (a subprocess each), so that what this test
process imported before does not hide what an import loads. The cycle check reads the
source with ast: every import statement counts, at module level or inside a function (a
lazy import is still a dependency; it only moves the failure to the first call)."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.unit import test_docker_install as dockerfile
from tierps.client.admin import ClusterAdmin
from tierps.core.config import TableConfig
from tierps.server import cli
from tierps.server.config import ServerConfig
from tierps.server.daemon import create_server

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]

# What a trainer's process must not load: the shard's storage engine and daemon, RocksDB's
# binding, and cupy (a trainer's GPU is torch's; cupy belongs to the GPU tier).
NOT_IN_A_TRAINER = ("tierps.storage", "tierps.server", "rocksdict", "cupy")
# tierps.core sits below every other tierps package.
ABOVE_CORE = ("tierps.storage", "tierps.server", "tierps.client", "tierps.proto", "tierps.demo")
# What tierps.core's source may import: the standard library, numpy, numba (the compiled
# checks, optional) and cupy (core/xp.py, only inside the functions that meet cupy arrays).
CORE_MAY_IMPORT = {"numpy", "numba", "cupy", "tierps"} | set(sys.stdlib_module_names)


def loaded_after(code: str) -> list[str]:
    """The modules a fresh interpreter holds after running `code`."""
    script = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def under(modules: list[str], prefixes: tuple[str, ...]) -> list[str]:
    return [m for m in modules if any(m == p or m.startswith(p + ".") for p in prefixes)]


@pytest.mark.slow  # real subprocesses: seconds
def test_a_trainer_imports_no_storage_engine_server_or_cupy() -> None:
    modules = loaded_after("import tierps.client, tierps.client.torch, tierps.client.distributed")
    assert "tierps.client.distributed" in modules and "tierps.core.config" in modules
    assert under(modules, NOT_IN_A_TRAINER) == []


def test_core_imports_nothing_above_it_and_no_cupy() -> None:
    names = sorted(p.stem for p in (ROOT / PACKAGE_DIRS["tierps.core"]).glob("*.py"))
    assert "config" in names and "ownership" in names
    imports = "; ".join(f"import tierps.core.{name}" for name in names if name != "__init__")
    modules = loaded_after(imports)
    assert "tierps.core.ownership" in modules
    assert under(modules, (*ABOVE_CORE, "rocksdict", "cupy")) == []


def test_core_source_imports_only_the_standard_library_numpy_and_numba() -> None:
    """What the source says, function-level imports included (core/xp.py's cupy is one)."""
    graph = import_graph()
    modules = modules_by_name()
    outside: list[str] = []
    for module, path in modules.items():
        if not module.startswith("tierps.core"):
            continue
        for name in imported_names(path, module, modules):
            top = name.split(".")[0]
            if top not in CORE_MAY_IMPORT or name.startswith(ABOVE_CORE):
                outside.append(f"{module} imports {name}")
    assert outside == []
    assert graph["tierps.core.ownership"] >= {"tierps.core.config", "tierps.core.compiled"}


# ----------------------------------------------------------------------------- the extra


def requirement_names(requirements: list[str]) -> set[str]:
    """The distribution names of pyproject requirement strings, normalised (PEP 503)."""
    return {
        re.sub(r"[-_.]+", "-", re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0]).lower()
        for r in requirements
    }


EXTRAS = PYPROJECT["project"]["optional-dependencies"]


def test_the_cli_checks_the_modules_of_the_server_extra() -> None:
    """cli.SERVER_EXTRA_MODULES, which `tierps serve` and the others check, is what the
    server extra installs (the top-level modules of its distributions), so neither list
    drifts."""
    wanted = requirement_names(EXTRAS["server"])
    installed = {
        module
        for module, distributions in importlib.metadata.packages_distributions().items()
        if requirement_names(distributions) & wanted and not module.startswith("_")
    }
    assert set(cli.SERVER_EXTRA_MODULES) == installed


def test_every_install_that_runs_shards_takes_the_server_extra() -> None:
    """The base dependencies are a trainer's; the server extra adds the shard's, and the
    dev extra (which CI installs), the image and nothing else pull it in."""
    base = requirement_names(PYPROJECT["project"]["dependencies"])
    server = requirement_names(EXTRAS["server"])
    assert "rocksdict" in server and "rocksdict" not in base and not base & server
    assert "tierps[server]" in EXTRAS["dev"]
    assert '-e ".[dev]"' in (ROOT / ".ci" / "run").read_text()
    installs = [
        rest for word, rest in dockerfile.instructions() if word == "RUN" and "pip install" in rest
    ]
    assert any("/tmp/src[server]" in rest for rest in installs), installs


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--shard-id", "0", "--num-shards", "1", "--data-dir", "DATA"],
        ["cluster", "--shards", "1", "--data-dir", "DATA"],
        ["demo", "--epochs", "1"],
        ["storage-demo", "--data-dir", "DATA"],
    ],
    ids=lambda argv: argv[0],
)
def test_a_command_that_runs_shards_names_the_missing_extra(
    argv: list[str], tmp_path: Path
) -> None:
    """Without the server extra (its modules made unimportable in the child, as an install
    without them is), the command exits 1 with one line naming the extra: no traceback."""
    argv = [str(tmp_path / "data") if a == "DATA" else a for a in argv]
    code = (
        "import sys\n"
        f"for name in {list(cli.SERVER_EXTRA_MODULES)!r}:\n"
        "    sys.modules[name] = None  # import fails as if not installed\n"
        "from tierps.server.cli import main\n"
        f"raise SystemExit(main({argv!r}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 1, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"tierps {argv[0]}: ")
    assert "pip install 'tierps[server]'" in lines[0]
    assert not (tmp_path / "data").exists()


@pytest.mark.slow  # real subprocesses: seconds
def test_admin_runs_without_the_server_extra(tmp_path: Path) -> None:
    """A trainer's machine runs `tierps admin` (a client of the cluster) without rocksdict
    and the shard's gRPC services: against a real shard, it lists the shard's table."""
    server, port = create_server(
        ServerConfig(shard_id=0, num_shards=1, data_dir=tmp_path / "shard", port=0)
    )
    with server, ClusterAdmin([f"127.0.0.1:{port}"]) as admin:
        admin.create_table(TableConfig("listed", 4))
        code = (
            "import sys\n"
            f"for name in {list(cli.SERVER_EXTRA_MODULES)!r}:\n"
            "    sys.modules[name] = None\n"
            "from tierps.server.cli import main\n"
            f"status = main(['admin', '--addresses', '127.0.0.1:{port}', 'tables'])\n"
            "loaded = [m for m in sys.modules if m.startswith(('tierps.storage', 'rocksdict'))]\n"
            "print('loaded', [m for m in loaded if sys.modules[m] is not None])\n"
            "raise SystemExit(status)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT
        )
    assert done.returncode == 0, done.stderr
    assert "listed" in done.stdout and "loaded []" in done.stdout, done.stdout


# ---------------------------------------------------------------------------- the cycles


def modules_by_name() -> dict[str, Path]:
    """Every tierps module (as pyproject's package-dir maps the folders) and its file."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found


def imported_names(path: Path, module: str, modules: dict[str, Path]) -> list[str]:
    """What each import statement of the file imports, anywhere in it (module level,
    functions, `if TYPE_CHECKING`): `import a.b` gives a.b; `from a import b` gives a.b
    where that is a module of `modules`, else a; relative imports resolved against the
    file's package."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names += [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the tierps modules it imports. The implicit import of a module's parent
    packages is not an edge: Python runs a package's __init__ before any of its modules, so
    counting it would make every package that re-exports its own modules a cycle."""
    modules = modules_by_name()
    return {
        module: {name for name in imported_names(path, module, modules) if name in modules}
        - {module}
        for module, path in modules.items()
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as [a, b, ..., a], or None: a depth-first search that keeps
    the path it is on; an edge back into the path closes a cycle."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        pending = [iter(sorted(graph[start]))]
        while pending:
            following = next(pending[-1], None)
            if following is None:  # every edge of path[-1] followed: no cycle through it
                done.add(path.pop())
                pending.pop()
            elif following in path:
                return [*path[path.index(following) :], following]
            elif following not in done:
                path.append(following)
                pending.append(iter(sorted(graph[following])))
    return None


def test_find_cycle_finds_one_and_only_one() -> None:
    """The search itself, on graphs whose answer is known."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"d"}, "c": {"d"}, "d": set()}) is None  # diamond
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"b"}}) == ["b", "c", "b"]
    assert find_cycle({"x": {"x"}}) == ["x", "x"]


def test_the_graph_reads_lazy_relative_and_from_imports(tmp_path: Path) -> None:
    """imported_names on a file holding each form the graph must read."""
    source = (
        "import tierps.core.config\n"
        "from . import sibling\n"
        "from .other import thing\n"
        "def later():\n"
        "    from tierps.storage import host_kernels\n"
    )
    path = tmp_path / "mod.py"
    path.write_text(source)
    names_there = ("tierps.client.sibling", "tierps.client.other", "tierps.storage.host_kernels")
    modules = {name: path for name in names_there}
    names = imported_names(path, "tierps.client.mod", modules)
    assert "tierps.core.config" in names
    assert "tierps.client.sibling" in names
    assert "tierps.client.other" in names  # `thing` is no module: its module is
    assert "tierps.storage.host_kernels" in names  # a function's import counts


def test_no_tierps_module_imports_itself_through_others() -> None:
    graph = import_graph()
    assert graph["tierps.storage.store"] >= {"tierps.storage.host_kernels"}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
