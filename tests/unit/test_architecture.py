"""The package's dependency rules, checked on the source (an AST scan, nothing imported).

The package has floors, bottom first: the leaves (settings, errors, the metric instruments, the request record, the
shared types, deadlines, the background task), the foundations (the engine package: what we know about vLLM; the
Redis boundary; the usage counters that keys and limits both read), the services (keys, limits, the relay, the
supervisor, the doctor, the scrape answers), the services container, the API layer (routes, validation, schemas),
the composition root (the app and its middleware), the HTTP edge (server, workers, the fenced uvicorn internals)
and the command line on top. An import runs down or sideways, never up; rules between neighbours on one floor
follow. A failure lists every offending
`file:line`, so the fix is in the code, not in this test.
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "gateway"

LEAVES = (
    "gateway/settings.py",
    "gateway/errors.py",
    "gateway/metrics/instruments.py",
    "gateway/request_record.py",
    "gateway/types.py",
    "gateway/deadline.py",
    "gateway/background.py",
    "gateway/tracing/otlp.py",
)
OPTIONAL_LEAVES = ("gateway/engine/supervisor_state.py",)
FOUNDATIONS = ("gateway/engine/", "gateway/redis/", "gateway/usage.py")
SERVICES = (
    "gateway/auth/",
    "gateway/ratelimit/",
    "gateway/relay/",
    "gateway/supervisor/",
    "gateway/doctor/",
    "gateway/metrics/",
    "gateway/responses/",
    "gateway/tracing/",
    "gateway/pool/",
)
WEB_LAYER = ("fastapi", "starlette", "gateway.api", "gateway.app", "gateway.http", "gateway.services")
ENVIRONMENT_READERS = ("gateway/settings.py", "gateway/engine/", "gateway/supervisor/", "gateway/doctor/")
# The doctor checks what the supervisor would start: settings, errors, its own modules and the engine package
# (profiles and the argv builder, the status file, NVML); nothing of the request path but the one Redis boundary
# (its Redis row connects as the gateway does: plain or Sentinel).
DOCTOR_MAY_IMPORT = ("gateway.settings", "gateway.redis", "gateway.errors", "gateway.doctor", "gateway.engine")
# The command line: it starts things, so it alone may import the supervisor (its entry modules included).
CLI_LAYER = ("gateway/cli.py", "gateway/__main__.py", "gateway/supervisor/__main__.py", "gateway/doctor/__main__.py")
# Bottom first; a module sits on the highest floor that names it (an exact file before its package).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("leaves", LEAVES),
    ("foundations", FOUNDATIONS),
    ("services", SERVICES),
    ("services container", ("gateway/services.py",)),
    ("API layer", ("gateway/api/",)),
    # The app assembles the middleware, which reads only leaves: it sits beside the app, under the server.
    ("composition root", ("gateway/app.py", "gateway/http/middleware.py")),
    ("HTTP edge", ("gateway/http/",)),
    ("command line", CLI_LAYER),
)
# What the engine package reads: settings (its one input), errors, what the OTEL_* variables say (a leaf: vLLM's own
# tracing goes to the gateway's collector) and itself; nothing that runs or serves.
ENGINE_MAY_IMPORT = ("gateway.settings", "gateway.errors", "gateway.tracing.otlp", "gateway.engine")
DOCTOR_NEVER_IMPORTS = ("aiohttp", "fastapi", "starlette", "uvicorn", "gateway.relay", "gateway.app")
# Top-level packages of the `cpu`/`gpu` extras, which the test environment need not have.
OPTIONAL_EXTRAS = {"torch", "vllm", "flash_attn", "pynvml", "safetensors", "tokenizers", "transformers"}
_OS_ENV_NAMES = frozenset({"environ", "environb", "getenv", "getenvb", "putenv", "unsetenv"})


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repository root, e.g. "gateway/relay/sse.py"
    line: int
    module: str  # absolute dotted name, e.g. "gateway.relay.client"
    local: bool  # inside a function or class body (and not under `if TYPE_CHECKING:`)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: imports {self.module}"


def _source_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(node: ast.AST, local: bool) -> Iterator[tuple[ast.AST, bool]]:
    """Every node with whether it sits in a function or class body (TYPE_CHECKING blocks are exempt)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield stmt, False
                yield from _walk(stmt, False)
            for stmt in child.orelse:
                yield stmt, local
                yield from _walk(stmt, local)
            continue
        child_local = local or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda)
        yield child, local
        yield from _walk(child, child_local)


def _resolve(path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = _module_name(path).split(".")
    if path.name != "__init__.py":
        package.pop()
    base = package[: len(package) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _imports(path: Path) -> Iterator[Import]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = _rel(path)
    for node, local in _walk(tree, False):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(rel, node.lineno, alias.name, local)
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(path, node)
            yield Import(rel, node.lineno, module, local)
            for alias in node.names:
                # `from gateway import app` imports the module gateway.app.
                candidate = f"{module}.{alias.name}"
                as_path = ROOT.joinpath(*candidate.split("."))
                if as_path.with_suffix(".py").is_file() or (as_path / "__init__.py").is_file():
                    yield Import(rel, node.lineno, candidate, local)


@functools.cache
def _all_imports() -> tuple[Import, ...]:
    return tuple(imp for path in _source_files() for imp in _imports(path))


def _is_within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _in(file: str, places: tuple[str, ...]) -> bool:
    return any(file == p or (p.endswith("/") and file.startswith(p)) for p in places)


def _report(violations: list[str]) -> str:
    return "\n".join(["dependency rule broken:", *violations])


def test_the_scan_sees_the_package() -> None:
    imports = _all_imports()
    assert len(_source_files()) >= 15
    # Known edges, so a broken resolver cannot make every rule pass vacuously.
    edges = {(i.file, i.module) for i in imports}
    assert ("gateway/app.py", "gateway.api.relayed") in edges
    assert ("gateway/relay/sse.py", "gateway.relay.client") in edges
    assert ("gateway/http/server.py", "gateway.app") in edges
    assert ("gateway/http/server.py", "gateway.http.uvicorn_internals") in edges
    assert ("gateway/http/uvicorn_internals.py", "gateway.http.client_limits") in edges
    assert ("gateway/relay/client.py", "gateway.relay.http1") in edges


def test_leaves_import_no_other_gateway_module() -> None:
    leaves = (*LEAVES, *(p for p in OPTIONAL_LEAVES if (ROOT / p).is_file()))
    for leaf in LEAVES:
        assert (ROOT / leaf).is_file(), leaf
    violations = [str(i) for i in _all_imports() if i.file in leaves and _is_within(i.module, ("gateway",))]
    assert not violations, _report(violations)


def test_services_never_import_the_web_layer() -> None:
    violations = [str(i) for i in _all_imports() if _in(i.file, SERVICES) and _is_within(i.module, WEB_LAYER)]
    assert not violations, _report(violations)


def test_supervisor_never_imports_the_relay() -> None:
    violations = [
        str(i)
        for i in _all_imports()
        if _in(i.file, ("gateway/supervisor/",)) and _is_within(i.module, ("gateway.relay",))
    ]
    assert not violations, _report(violations)


def test_doctor_imports_only_settings_errors_its_own_modules_and_engine_data() -> None:
    violations = [
        str(i)
        for i in _all_imports()
        if _in(i.file, ("gateway/doctor/",))
        and (
            _is_within(i.module, DOCTOR_NEVER_IMPORTS)
            or (_is_within(i.module, ("gateway",)) and not _is_within(i.module, DOCTOR_MAY_IMPORT))
        )
    ]
    assert not violations, _report(violations)


def _module_file(module: str) -> str | None:
    """The source file of a gateway module (`gateway.engine` -> gateway/engine/__init__.py), or None."""
    as_path = ROOT.joinpath(*module.split("."))
    for candidate in (as_path.with_suffix(".py"), as_path / "__init__.py"):
        if candidate.is_file():
            return _rel(candidate)
    return None


def _floor(file: str) -> int | None:
    """The floor a file sits on (0 = the leaves), or None for a module no floor names."""
    exact = [n for n, (_, places) in enumerate(FLOORS) if file in places]
    if exact:
        return exact[-1]
    return next((n for n in reversed(range(len(FLOORS))) if _in(file, FLOORS[n][1])), None)


def _upward(imports: tuple[Import, ...]) -> list[str]:
    violations = []
    for i in imports:
        target = _module_file(i.module) if _is_within(i.module, ("gateway",)) else None
        below, above = _floor(i.file), None if target is None else _floor(target)
        if below is not None and above is not None and above > below:
            violations.append(f"{i} ({FLOORS[below][0]} imports {FLOORS[above][0]})")
    return violations


def test_the_floors_name_real_files_and_known_edges_run_down() -> None:
    for _, places in FLOORS:
        for place in places:
            assert (ROOT / place).exists(), place
    assert _floor("gateway/engine/launch.py") == 1 and _floor("gateway/supervisor/supervisor.py") == 2
    assert _floor("gateway/supervisor/__main__.py") == 7 and _floor("gateway/api/relayed.py") == 4
    assert _floor("gateway/types.py") == 0 and _floor("gateway/relay/http1.py") == 2
    assert _floor("gateway/metrics/instruments.py") == 0 and _floor("gateway/metrics/exposition.py") == 2
    assert _floor("gateway/http/middleware.py") == 5 and _floor("gateway/http/server.py") == 6
    assert _floor("gateway/__init__.py") is None
    every_module = [_rel(p) for p in _source_files() if p.name != "__init__.py"]
    assert [f for f in every_module if _floor(f) is None] == [], "a module on no floor"
    edges = {(i.file, i.module) for i in _all_imports()}
    assert ("gateway/supervisor/supervisor.py", "gateway.engine.launch") in edges
    assert ("gateway/doctor/runner.py", "gateway.engine.profiles") in edges


def test_no_import_runs_from_a_lower_floor_to_a_higher_one() -> None:
    violations = _upward(_all_imports())
    assert not violations, _report(violations)


def test_the_floor_check_catches_an_upward_import() -> None:
    probes = (
        Import("gateway/engine/launch.py", 1, "gateway.supervisor.process", False),
        Import("gateway/doctor/runner.py", 2, "gateway.cli", False),
        Import("gateway/settings.py", 3, "gateway.engine.supervisor_state", False),
        Import("gateway/cli.py", 4, "gateway.engine.flags", False),  # down: allowed
        Import("gateway/supervisor/cli.py", 5, "gateway.doctor", False),  # sideways: allowed
        Import("gateway/relay/exchange.py", 6, "gateway.services", False),
        Import("gateway/services.py", 7, "gateway.api.context", False),
        Import("gateway/api/validation.py", 8, "gateway.http.middleware", False),
        Import("gateway/app.py", 9, "gateway.http.middleware", False),  # beside: allowed
        Import("gateway/http/middleware.py", 10, "gateway.http.server", False),
    )
    assert [v.split(":")[1] for v in _upward(probes)] == ["1", "2", "3", "6", "7", "8", "10"]


def test_the_engine_package_imports_only_settings_errors_and_itself() -> None:
    violations = [
        str(i)
        for i in _all_imports()
        if _in(i.file, ("gateway/engine/",))
        and _is_within(i.module, ("gateway",))
        and not _is_within(i.module, ENGINE_MAY_IMPORT)
    ]
    assert not violations, _report(violations)


def test_only_the_command_line_imports_the_supervisor() -> None:
    violations = [
        str(i)
        for i in _all_imports()
        if _is_within(i.module, ("gateway.supervisor",)) and not _in(i.file, ("gateway/supervisor/", *CLI_LAYER))
    ]
    assert not violations, _report(violations)


def test_the_gateway_never_imports_the_engine_plugin_nor_the_plugin_the_gateway() -> None:
    """engine_patches runs inside vLLM's processes: the gateway only finds its templates' path, without importing it."""
    violations = [str(i) for i in _all_imports() if _is_within(i.module, ("engine_patches",))]
    plugin_files = sorted((ROOT / "engine_patches").rglob("*.py"))
    assert any(p.name == "plugin.py" for p in plugin_files)
    violations += [str(i) for p in plugin_files for i in _imports(p) if _is_within(i.module, ("gateway", "loadtest"))]
    assert not violations, _report(violations)


# What the load tool may import of the package: nothing. It drives the gateway across process boundaries (HTTP, the
# supervisor as a child process, its status file); its process runner, which the tests share, is its own.
LOADTEST_MAY_IMPORT: tuple[str, ...] = ()


def test_the_load_tool_imports_nothing_of_the_gateway_and_the_tests_share_its_runner() -> None:
    loadtest = [i for p in sorted((ROOT / "loadtest").rglob("*.py")) for i in _imports(p)]
    violations = [
        str(i) for i in loadtest if _is_within(i.module, ("gateway",)) and not _is_within(i.module, LOADTEST_MAY_IMPORT)
    ]
    assert not violations, _report(violations)
    assert ("tests/procs.py", "loadtest.processes") in {(i.file, i.module) for i in _imports(ROOT / "tests/procs.py")}


def _top_level_definitions(tree: ast.Module) -> dict[str, ast.stmt]:
    """Name -> statement of each function, class and assigned name at a module's top level."""
    found: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            found[node.name] = node
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update((t.id, node) for t in targets if isinstance(t, ast.Name))
    return found


def _used_in_own_module(tree: ast.Module, name: str, definition: ast.stmt) -> bool:
    """Whether `name` is read in its module outside its own definition, or registered there by a decorator."""
    if isinstance(definition, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and definition.decorator_list:
        return True
    return any(
        isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)
        for top in tree.body
        if top is not definition
        for node in ast.walk(top)
    )


def _only_for_outsiders(importers: list[Path], package: Path, entry_points: set[tuple[str, str]]) -> list[str]:
    """`file:line: module.name` for each name `importers` import from `package` that no module of the package uses:
    neither its own module (a decorator registering it counts) nor another one importing it, nor an entry point.

    An attribute of that name read anywhere in the package counts as a use (`lua.ACQUIRE`, or `module.print_argv`
    on a module the command line loads by name), so the check errs toward passing, never toward a false alarm."""
    used = set(entry_points)
    attributes: set[str] = set()
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = _resolve(path, node) if node.level else node.module or ""
                used.update((module, alias.name) for alias in node.names)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                attributes.add(node.attr)
    violations = []
    for importer in importers:
        for node in ast.walk(ast.parse(importer.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module):
                continue
            if not _is_within(node.module, (package.name,)):
                continue
            source = package.parent.joinpath(*node.module.split(".")).with_suffix(".py")
            if not source.is_file():
                continue  # a package's __init__ re-exports names defined elsewhere
            tree = ast.parse(source.read_text())
            definitions = _top_level_definitions(tree)
            for alias in node.names:
                definition = definitions.get(alias.name)
                if definition is None or (node.module, alias.name) in used or alias.name in attributes:
                    continue
                if not _used_in_own_module(tree, alias.name, definition):
                    violations.append(f"{importer.name}:{node.lineno}: {node.module}.{alias.name} serves only it")
    return violations


def test_nothing_in_the_package_exists_only_for_the_tests_or_the_load_tool() -> None:
    """Test tooling lives with its users (tests/, loadtest/), not in the product: every name the tests or the load
    tool import from `gateway` is one the product itself uses."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"].values()
    entry_points = {(module, name) for module, name in (target.split(":") for target in scripts)}
    importers = [p for folder in ("tests", "loadtest") for p in sorted((ROOT / folder).rglob("*.py"))]
    violations = _only_for_outsiders(importers, PACKAGE, entry_points)
    assert not violations, _report(violations)


def test_the_outsider_check_catches_a_name_only_a_test_uses(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text(
        "def only_for_tests(): pass\n"
        "def helper(): pass\n"
        "def api(): return helper()\n"
        "def loaded_by_name(): pass\n"
        "@register\n"
        "def route(): pass\n"
        "def main(): pass\n"
    )
    (package / "user.py").write_text(
        "import importlib\nfrom pkg.mod import api\nimportlib.import_module('pkg.mod').loaded_by_name()\n"
    )
    test = tmp_path / "test_probe.py"
    test.write_text(
        "from pkg.mod import only_for_tests, helper, api, route, main, loaded_by_name\nfrom pkg.user import api\n"
    )
    assert _only_for_outsiders([test], package, {("pkg.mod", "main")}) == [
        "test_probe.py:1: pkg.mod.only_for_tests serves only it"
    ]


def test_nothing_but_the_server_imports_the_app() -> None:
    violations = [
        str(i) for i in _all_imports() if i.file != "gateway/http/server.py" and _is_within(i.module, ("gateway.app",))
    ]
    assert not violations, _report(violations)


def test_only_the_supervisor_and_the_command_line_run_the_doctor() -> None:
    """The doctor is a preflight the supervisor runs and a verb of the command line; what it reads of the machine
    (NVML, the engine's flags) lives in the engine package, where the scrape answers read it too."""
    violations = [
        str(i)
        for i in _all_imports()
        if _is_within(i.module, ("gateway.doctor",))
        and not _in(i.file, ("gateway/doctor/", "gateway/supervisor/", *CLI_LAYER))
    ]
    assert not violations, _report(violations)


def test_only_the_app_imports_the_api_layer() -> None:
    violations = [
        str(i)
        for i in _all_imports()
        if i.file != "gateway/app.py"
        and not _in(i.file, ("gateway/api/",))  # the package's own modules
        and _is_within(i.module, ("gateway.api",))
    ]
    assert not violations, _report(violations)


def test_only_the_uvicorn_internals_module_imports_uvicorns_protocols_or_server() -> None:
    """What relies on uvicorn's internals lives in one module, whose declaration tests/unit/test_library_internals.py
    checks against the installed uvicorn."""
    internal = ("uvicorn.protocols", "uvicorn.server", "uvicorn.Server", "uvicorn.Config")
    violations = [
        str(i)
        for i in _all_imports()
        if i.file != "gateway/http/uvicorn_internals.py" and (_is_within(i.module, internal) or i.module == "uvicorn")
    ]
    assert not violations, _report(violations)


def test_auth_never_imports_the_rate_limiter() -> None:
    """Keys and limits are sibling services: the `keys` CLI reads usage through gateway.usage, below both."""
    violations = [
        str(i)
        for i in _all_imports()
        if _in(i.file, ("gateway/auth/",)) and _is_within(i.module, ("gateway.ratelimit",))
    ]
    assert not violations, _report(violations)


def test_only_the_redis_boundary_reaches_into_redis_py() -> None:
    """redis-py below its client and its exceptions (connections, parsers, scripts) is used in gateway/redis/ alone,
    whose declaration tests/unit/test_library_internals.py checks against the installed redis-py."""
    violations = [
        str(i)
        for i in _all_imports()
        if not _in(i.file, ("gateway/redis/",))
        and _is_within(i.module, ("redis",))
        and i.module not in ("redis.asyncio", "redis.exceptions")
    ]
    assert not violations, _report(violations)


def test_only_the_engine_client_speaks_http_to_the_engine() -> None:
    """One HTTP client on the relay path (relay/http1.py, httptools' response parser): no gateway module imports
    aiohttp, and none but http1.py parses HTTP answers."""
    violations = [str(i) for i in _all_imports() if _is_within(i.module, ("aiohttp",))]
    violations += [
        f"{_rel(path)}:{node.lineno}: names HttpResponseParser"
        for path in _source_files()
        if _rel(path) != "gateway/relay/http1.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.Attribute) and node.attr == "HttpResponseParser")
        or (isinstance(node, ast.alias) and node.name == "HttpResponseParser")
    ]
    assert not violations, _report(violations)


def test_the_package_holds_no_model_writer() -> None:
    """Writing a model (torch, safetensors, tokenizers) is a development tool's work (tools/demo_model.py), outside
    the package: nothing the wheel ships as `gateway` imports those."""
    violations = [str(i) for i in _all_imports() if _is_within(i.module, ("torch", "safetensors", "tokenizers"))]
    assert not violations, _report(violations)
    assert (ROOT / "tools" / "demo_model.py").is_file()


def test_no_function_local_imports() -> None:
    violations = [f"{i.file}:{i.line}: local import of {i.module}" for i in _all_imports() if i.local]
    assert not violations, _report(violations)


def test_local_import_detection() -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import a\n"
        "def f():\n    import b\n"
        "class C:\n    from c import d\n"
        "async def g():\n    if True:\n        import e\n"
        "try:\n    import h\nexcept ImportError:\n    pass\n"
    )
    found = {
        (node.names[0].name, local)
        for node, local in _walk(ast.parse(source), False)
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    assert found == {("TYPE_CHECKING", False), ("a", False), ("b", True), ("d", True), ("e", True), ("h", False)}


def _environment_access(source: str, name: str) -> Iterator[str]:
    tree = ast.parse(source, filename=name)
    os_names = {"os"} | {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name == "os"
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "os":
            for alias in node.names:
                if alias.name in _OS_ENV_NAMES:
                    yield f"{name}:{node.lineno}: from os import {alias.name}"
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in _OS_ENV_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id in os_names
        ):
            yield f"{name}:{node.lineno}: os.{node.attr}"


def test_environment_is_read_only_by_settings_and_the_supervisor() -> None:
    violations = [
        v
        for path in _source_files()
        if not _in(_rel(path), ENVIRONMENT_READERS)
        for v in _environment_access(path.read_text(), _rel(path))
    ]
    assert not violations, _report(violations)


def test_environment_scan_catches_every_form() -> None:
    source = "import os as o\nfrom os import getenv\nx = o.environ['A']\ny = os.getenv('B')\nz = len(environ)\n"
    assert list(_environment_access(source, "probe.py")) == [
        "probe.py:2: from os import getenv",
        "probe.py:3: os.environ",
        "probe.py:4: os.getenv",
    ]


_IMPORT_PROBE = """
import importlib, json, logging, os, sys, threading
names = json.loads(sys.argv[1])
before = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()
unavailable = {}
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "gateway":
            raise
        unavailable[name] = exc.name.split(".")[0]
after = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else set()
sockets = []
for fd in after - before:
    try:
        if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
            sockets.append(fd)
    except OSError:
        pass
from prometheus_client import REGISTRY
print(json.dumps({
    "threads": [t.name for t in threading.enumerate()],
    "sockets": sockets,
    "root_handlers": len(logging.getLogger().handlers),
    "default_registry": sorted(n for n in REGISTRY._names_to_collectors if n.startswith("nemotron")),
    "unavailable": unavailable,
}))
"""


def test_importing_every_module_has_no_side_effects() -> None:
    # A fresh interpreter: the test process has already imported half the package.
    modules = sorted(_module_name(p) for p in _source_files() if p.stem != "__main__")
    assert "gateway.app" in modules and "gateway.relay.sse" in modules
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, json.dumps(modules)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=25,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""
    found = json.loads(result.stdout)
    assert found["threads"] == ["MainThread"]
    assert found["sockets"] == []
    assert found["root_handlers"] == 0
    assert found["default_registry"] == []
    # Modules of the optional extras (vLLM for the doctor's engine-config check) may be missing here; the core never is.
    assert set(found["unavailable"].values()) <= OPTIONAL_EXTRAS, found["unavailable"]
    assert not set(found["unavailable"]) & {"gateway.app", "gateway.cli", "gateway.relay.sse", "gateway.settings"}


def test_the_engine_entry_point_loads_no_web_stack() -> None:
    # `nemotron-engine` (the engine unit's ExecStart) runs the supervisor alone: a fresh interpreter imports
    # its module and the supervisor's verbs it loads, and must not have loaded the HTTP app, FastAPI or aiohttp.
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module = scripts["nemotron-engine"].split(":")[0]
    probe = f"import sys, json, {module}, gateway.supervisor.cli; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=25)
    assert result.returncode == 0, result.stderr
    web = ("fastapi", "starlette", "aiohttp", "uvicorn", "gateway.app", "gateway.relay", "gateway.api")
    loaded = [name for name in json.loads(result.stdout) if name.startswith(web)]
    assert loaded == [], f"{module} loads {loaded}"


def test_every_module_counting_the_fake_engines_shm_files_shares_one_xdist_group() -> None:
    """Two such modules on two workers at once see each other's files (`make test` runs three workers)."""
    from tests.conftest import SHM_COUNTING_MODULES

    tests_dir = Path(__file__).resolve().parents[1]
    counting = {
        path.relative_to(tests_dir.parent).as_posix()
        for path in tests_dir.rglob("test_*.py")
        if path != Path(__file__).resolve() and "fake_shm_files()" in path.read_text()
    }
    assert counting, "the scan found no module counting the fake engine's /dev/shm files"
    assert counting <= SHM_COUNTING_MODULES, sorted(counting - SHM_COUNTING_MODULES)
