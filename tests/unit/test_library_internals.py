"""The uvicorn and redis-py internals the gateway relies on are all there in the installed libraries.

The names come from the modules' own declarations (`INTERNALS` in gateway/http/uvicorn_internals.py and
gateway/redis/internals.py), so an upgrade that removes, renames or reshapes one fails here, naming it, instead of
failing requests. A subclass's overrides are checked against the declaration both ways: one it does not declare would
shadow a library method by accident. The parameters passed by name must still be there; and the installed version
must lie within the bounds pyproject.toml gives it, which are the versions these checks passed on.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import redis
import uvicorn

from gateway.http import uvicorn_internals
from gateway.redis import internals as redis_internals
from gateway.tracing import request as tracing_request
from gateway.types import LibraryInternals

pytestmark = pytest.mark.timeout(30)

ALL_INTERNALS = [
    (module, declared)
    for module in (uvicorn_internals, redis_internals, tracing_request)
    for declared in module.INTERNALS
]
DECLARED = [
    pytest.param(internals, id=f"{module.__name__.split('.', 1)[-1]}:{internals.library_class.__name__}")
    for module, internals in ALL_INTERNALS
]
SUBCLASSED = [
    pytest.param(internals, id=f"{internals.subclass.__name__}")
    for _, internals in ALL_INTERNALS
    if internals.subclass is not None
]
# The versions the modules' docstrings name as tested; a different one installed is a reminder to re-read them.
TESTED = {"uvicorn": (uvicorn, "0.54."), "redis": (redis, "8.")}


@functools.cache
def members(cls: type) -> frozenset[str]:
    """Every name an instance of `cls` has: class attributes, methods, slots, and the attributes its methods (and
    those of its bases) assign to `self`."""
    names = set(dir(cls))
    for klass in cls.__mro__:
        if klass is object:
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # a builtin or C class: `dir` saw what it has
            continue
        for node in ast.walk(ast.parse(source)):
            target = node.target if isinstance(node, ast.AnnAssign) else node
            if (
                isinstance(target, ast.Attribute)
                and isinstance(target.value, ast.Name)
                and target.value.id == "self"
                and isinstance(target.ctx, ast.Store)
            ):
                names.add(target.attr)
    return frozenset(names)


def _defined_by(subclass: type) -> set[str]:
    return {name for name in vars(subclass) if name not in {"__module__", "__qualname__", "__doc__", "__slots__"}}


@pytest.mark.parametrize("internals", DECLARED)
def test_every_name_relied_upon_exists_in_the_installed_library(internals: LibraryInternals) -> None:
    cls = internals.library_class
    missing = [name for name in (*internals.overridden, *internals.used) if name not in members(cls)]
    assert not missing, (
        f"{cls.__module__}.{cls.__qualname__} no longer has {missing}, which the gateway relies on; "
        "adapt the module that declares it (and its docstring) before allowing this version"
    )


@pytest.mark.parametrize("internals", DECLARED)
def test_overridden_methods_are_methods_with_the_signature_the_override_has(internals: LibraryInternals) -> None:
    cls, subclass = internals.library_class, internals.subclass
    for name in internals.overridden:
        theirs = getattr(cls, name, None)
        assert callable(theirs), f"{cls.__qualname__}.{name} is no longer a method"
        assert subclass is not None
        ours = inspect.signature(getattr(subclass, name))
        if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in ours.parameters.values()):
            continue  # passes whatever it gets on to the library's method
        assert list(inspect.signature(theirs).parameters) == list(ours.parameters), (
            f"{cls.__qualname__}.{name} now takes {inspect.signature(theirs)}; "
            f"{subclass.__qualname__}.{name} takes {ours}"
        )


@pytest.mark.parametrize("internals", DECLARED)
def test_parameters_passed_by_name_are_still_parameters(internals: LibraryInternals) -> None:
    cls = internals.library_class
    for name, passed in internals.called:
        parameters = inspect.signature(getattr(cls, name)).parameters
        gone = [parameter for parameter in passed if parameter not in parameters]
        assert not gone, f"{cls.__qualname__}.{name} does not take {gone}; it takes {list(parameters)}"


@pytest.mark.parametrize("internals", SUBCLASSED)
def test_a_subclass_overrides_exactly_what_is_declared(internals: LibraryInternals) -> None:
    subclass = internals.subclass
    assert subclass is not None
    shadowing = {name for name in _defined_by(subclass) if name in members(internals.library_class)}
    assert shadowing == set(internals.overridden), (
        f"{subclass.__qualname__} shadows {sorted(shadowing - set(internals.overridden))} of "
        f"{internals.library_class.__qualname__} without declaring it, or declares "
        f"{sorted(set(internals.overridden) - shadowing)} it does not override"
    )


_CYCLE = uvicorn.protocols.http.httptools_impl.RequestResponseCycle


def test_the_declared_shadowing_check_sees_an_undeclared_override() -> None:
    class Sneaky(_CYCLE):  # type: ignore[misc]  # uvicorn's class is untyped
        async def receive(self) -> None:  # uvicorn's own method, not declared below
            return None

    sneaky = LibraryInternals(_CYCLE, subclass=Sneaky, overridden=())
    with pytest.raises(AssertionError, match="receive"):
        test_a_subclass_overrides_exactly_what_is_declared(sneaky)


def test_a_name_gone_from_the_library_is_named_in_the_failure() -> None:
    gone = LibraryInternals(_CYCLE, used=("keep_alive", "_renamed_keep_alive"))
    with pytest.raises(AssertionError, match="no longer has \\['_renamed_keep_alive'\\]"):
        test_every_name_relied_upon_exists_in_the_installed_library(gone)


def test_a_parameter_gone_from_the_library_is_named_in_the_failure() -> None:
    renamed = LibraryInternals(_CYCLE, called=(("__init__", ("scope", "renamed_flow")),))
    with pytest.raises(AssertionError, match="does not take \\['renamed_flow'\\]"):
        test_parameters_passed_by_name_are_still_parameters(renamed)


def test_the_member_scan_finds_attributes_set_in_methods_and_misses_absent_ones() -> None:
    found = members(_CYCLE)
    assert {"chunked_encoding", "response_started", "keep_alive"} <= found
    assert "no_such_attribute" not in found


@pytest.mark.parametrize("library", sorted(TESTED))
def test_the_installed_version_is_the_one_the_modules_were_checked_with(library: str) -> None:
    module, prefix = TESTED[library]
    assert module.__version__.startswith(prefix), (
        f"{library} {module.__version__} is installed; the internals were read on {prefix}x: re-read what "
        "gateway/http/uvicorn_internals.py relies on, then update its docstring, this table and the bound in "
        "pyproject.toml"
    )


def test_redis_bounds_in_pyproject_are_those_the_internals_were_checked_on() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert redis_internals.REQUIREMENT in project["dependencies"], (
        f"pyproject.toml must require {redis_internals.REQUIREMENT!r}, the redis-py releases "
        "gateway/redis/internals.py was checked on"
    )
    assert redis_internals.supported(redis.__version__), (
        f"redis-py {redis.__version__} is installed, outside {redis_internals.REQUIREMENT}: re-read what "
        "gateway/redis/internals.py relies on, run these checks, then widen the bound there and in pyproject.toml"
    )


@pytest.mark.parametrize(
    ("version", "expected"),
    [("8.1.0", True), ("8.2.0", True), ("8.10.1rc1", True), ("8.0.1", False), ("7.4.1", False), ("9.0.0", False)],
)
def test_the_redis_bound_admits_the_releases_it_names_and_no_other(version: str, expected: bool) -> None:
    assert redis_internals.supported(version) is expected


def test_opentelemetry_bounds_in_pyproject_are_those_the_span_building_was_checked_on() -> None:
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]
    assert tracing_request.REQUIREMENT in project["dependencies"], (
        f"pyproject.toml must require {tracing_request.REQUIREMENT!r}, the SDK releases gateway/tracing/request.py "
        "was checked on"
    )
    installed = tuple(int(part) for part in metadata.version("opentelemetry-sdk").split(".")[:2])
    assert (1, 45) <= installed < (2, 0), (
        f"opentelemetry-sdk {metadata.version('opentelemetry-sdk')} is installed, outside "
        f"{tracing_request.REQUIREMENT}: re-read what gateway/tracing/request.py relies on, then widen the bound"
    )
