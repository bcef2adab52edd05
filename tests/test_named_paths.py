"""Every file or module that the READMEs and the code's docstrings name exists.

A reader follows these names first; a renamed or deleted file must not leave a pointer
behind. Paths are read in backticks or bare with a known top folder; dotted names under
``sightline.`` and ``bench.`` are resolved to files. Parsing only, no imports: < 1 s.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOP = ("collector", "instrumentation", "engine", "dashboards", "deploy", "tests", "bench",
       "scripts", ".ci")
SUFFIXES = ("py", "md", "json", "sh", "yml", "yaml", "log", "txt", "html", "gz", "bin", "toml")
# a path under a top folder: collector/explain.py, bench/results/x.md, deploy/kubernetes/
PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./<>{}*,-]*[\w/>}*])" % "|".join(re.escape(t) for t in TOP))
# a dotted module: sightline.collector.explain, bench.overhead_http (``python -m bench.x``)
MODULE = re.compile(r"(?<![\w.])(sightline\.[a-z_][\w.]*[a-z_\d]|bench\.[a-z_][\w]*)")
# a result file named alone in bench/README.md's table
RESULT = re.compile(r"`([\w.-]+\.(?:%s))`" % "|".join(SUFFIXES))
ROOMS = {"instrumentation", "engine", "collector", "dashboards", "deploy"}
PLACEHOLDER = re.compile(r"[*{}<>]|\.\.\.|NAME|XXX")


def _docs() -> list[tuple[str, str]]:
    """(where, text) for each README and each docstring of the code."""
    texts = [(p.relative_to(ROOT).as_posix(), p.read_text())
             for p in [ROOT / "README.md", *sorted(ROOT.glob("*/**/README.md"))]
             if ".venv" not in p.parts and p.exists()]
    for folder in ("instrumentation", "engine", "collector", "dashboards", "deploy", "bench", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        texts.append((path.relative_to(ROOT).as_posix(), doc))
    return texts


def _module_exists(dotted: str) -> bool:
    parts = dotted.split(".")
    if parts[0] == "sightline":
        if len(parts) < 2 or parts[1] not in ROOMS:
            return True    # sightline.<attribute name>, not a module
        base, rest = ROOT / parts[1], parts[2:]
    else:
        base, rest = ROOT / "bench", parts[1:]
    # the longest prefix that is a module or package; the next name must be defined there
    for i in range(len(rest), -1, -1):
        here = base.joinpath(*rest[:i])
        source = here.with_suffix(".py") if i and here.with_suffix(".py").exists() else here / "__init__.py"
        if source.exists():
            return i == len(rest) or re.search(rf"\b{rest[i]}\b", source.read_text()) is not None
    return False


def _missing() -> list[str]:
    missing = []
    for where, text in _docs():
        for raw in PATH.findall(text):
            path = raw.rstrip(".")
            if not PLACEHOLDER.search(path) and not (ROOT / path).exists():
                missing.append(f"{where}: {path}")
        for dotted in MODULE.findall(text):
            if not _module_exists(dotted.rstrip(".")):
                missing.append(f"{where}: {dotted}")
        if where == "bench/README.md":
            for name in RESULT.findall(text):
                if not (ROOT / "bench" / "results" / name).exists() and not (ROOT / "bench" / name).exists():
                    missing.append(f"{where}: results/{name}")
    return missing


def test_every_named_path_exists():
    assert _missing() == []


def test_the_check_sees_a_missing_path(tmp_path):
    assert PATH.findall("see `collector/explain.py` and bench/results/x.md.") == [
        "collector/explain.py", "bench/results/x.md"]
    assert not (ROOT / "collector/no_such_module.py").exists()
    assert _module_exists("sightline.collector.explain.explain_trace")
    assert not _module_exists("sightline.collector.no_such_module")
    assert not _module_exists("bench.no_such_script")
