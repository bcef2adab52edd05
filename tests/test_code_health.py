"""The house rules that a reader relies on, checked on every module of the rooms and bench/.

Module docstrings say what, the guarantee and the cost in at most 15 lines; code names no
team process; imports between the rooms follow the architecture's arrows, are relative
inside the package, and reach another room only through its declared surface (its
``__init__``'s ``__all__``) or ``instrumentation.semconv``. Parsing only, no imports: < 1 s.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("instrumentation", "engine", "collector", "dashboards", "deploy")
MAX_DOCSTRING_LINES = 15
# Which rooms each room may import (deploy puts the parts together: all of them).
MAY_IMPORT = {
    "instrumentation": set(),
    "engine": {"instrumentation"},
    "collector": {"instrumentation"},
    "dashboards": {"instrumentation"},
    "deploy": set(ROOMS),
}
PROCESS_REFERENCES = re.compile(r"TEAM\.md|\bE\d{1,2}'s\b|\(E\d{1,2}\b|\bby E\d{1,2}\b")

# Modules being rewritten elsewhere; each entry is removed once its module complies.
LONG_DOCSTRING_ALLOWED: set[str] = set()
PROCESS_REFERENCE_ALLOWED: set[str] = set()
IMPORTS_ALLOWED: set[str] = set()


def _modules(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _surface(room: str) -> set[str] | None:
    """The names a room's ``__init__`` lists in ``__all__``, or None when it declares none."""
    for node in _tree(ROOT / room / "__init__.py").body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            names = set()
            for element in node.value.elts:
                if isinstance(element, ast.Constant):
                    names.add(element.value)
                elif isinstance(element, ast.Starred):  # *_MODULE_OF: the keys of a dict literal
                    mapping = next(n.value for n in _tree(ROOT / room / "__init__.py").body
                                   if isinstance(n, ast.Assign) and n.targets[0].id == element.value.id)
                    names.update(k.value for k in mapping.keys)
            return names
    return None


def import_problems(path: Path, surfaces: dict[str, set[str] | None]) -> list[str]:
    """Every import of ``path`` (module level or inside functions) that breaks a rule."""
    package = ["sightline", *path.relative_to(ROOT).parent.parts]
    room = package[1]
    problems = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            targets = [(alias.name.split("."), [], True) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                targets = [((node.module or "").split("."), [a.name for a in node.names], True)]
            else:
                base = package[:len(package) - node.level + 1]
                module = base + (node.module.split(".") if node.module else [])
                targets = [(module, [a.name for a in node.names], False)]
        else:
            continue
        for module, names, absolute in targets:
            if module[0] != "sightline":
                continue
            where = f"{_name(path)}:{node.lineno}"
            if absolute:
                problems.append(f"{where}: absolute import of {'.'.join(module)} (use a relative one)")
            other = module[1] if len(module) > 1 else None
            if other is None or other == room:
                continue
            if other not in MAY_IMPORT[room]:
                problems.append(f"{where}: {room} imports {other}")
            surface = surfaces.get(other)
            if surface is None:
                continue
            if len(module) == 2:
                outside = sorted(set(names) - surface)
                if outside:
                    problems.append(f"{where}: {outside} are not in {other}'s __all__")
            elif module[2:] != ["semconv"]:
                problems.append(f"{where}: {'.'.join(module)} is behind {other}'s surface")
    return problems


def _docstring_lines(path: Path) -> int:
    return len((ast.get_docstring(_tree(path), clean=False) or "").strip().splitlines())


def _names_process(path: Path) -> list[tuple[int, str]]:
    return [(i, line.strip()) for i, line in enumerate(path.read_text().splitlines(), 1)
            if PROCESS_REFERENCES.search(line)]


def test_module_docstrings_say_what_guarantee_and_cost_briefly():
    long = {_name(p): _docstring_lines(p) for p in _modules(*ROOMS, "bench")
            if _name(p) not in LONG_DOCSTRING_ALLOWED and _docstring_lines(p) > MAX_DOCSTRING_LINES}
    assert not long, f"module docstrings over {MAX_DOCSTRING_LINES} lines: {long}"


def test_code_names_no_team_process():
    found = {_name(p): _names_process(p) for p in _modules(*ROOMS, "bench", "tests")
             if _name(p) not in PROCESS_REFERENCE_ALLOWED and _names_process(p)}
    assert not found, found


def test_imports_follow_the_rooms_and_their_surfaces():
    surfaces = {room: _surface(room) for room in ROOMS}
    assert surfaces["instrumentation"], "instrumentation/__init__.py declares no __all__"
    problems = [p for path in _modules(*ROOMS) if _name(path) not in IMPORTS_ALLOWED
                for p in import_problems(path, surfaces)]
    assert not problems, "\n".join(problems)


def test_allow_lists_name_only_modules_that_still_need_them():
    surfaces = {room: _surface(room) for room in ROOMS}
    for name in LONG_DOCSTRING_ALLOWED:
        assert _docstring_lines(ROOT / name) > MAX_DOCSTRING_LINES, f"{name} complies: drop it"
    for name in PROCESS_REFERENCE_ALLOWED:
        assert _names_process(ROOT / name), f"{name} complies: drop it"
    for name in IMPORTS_ALLOWED:
        assert import_problems(ROOT / name, surfaces), f"{name} complies: drop it"


def test_the_declared_surface_resolves():
    import sightline.instrumentation as surface

    missing = [name for name in surface.__all__ if not hasattr(surface, name)]
    assert not missing, missing
    assert sorted(dir(surface)) == sorted(set(dir(surface)) | set(surface.__all__))


def test_no_test_module_imports_another():
    """Shared fixtures and builders live in conftest.py or a support module, so that each
    test module can be read, run and changed alone."""
    offenders = []
    for path in _modules("tests"):
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module:
                leaf = node.module.rsplit(".", 1)[-1]
                if leaf.startswith("test_") and leaf != path.stem:
                    offenders.append(f"{_name(path)}: from {node.module}")
    assert offenders == []
