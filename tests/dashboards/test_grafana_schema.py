"""The generated dashboards against Grafana's published dashboard schema (``@grafana/schema``).

Each dashboard's JSON is written into a TypeScript file as an object literal typed with
the schema's ``Dashboard`` (enum members loosened to their string values, as JSON spells
them, plus the import dialog's ``__inputs``) and type-checked with ``tsc --strict``:
a field the schema does not define, a wrong type or ``null`` where an object belongs is
an error. The same check on a dashboard with such a field injected must fail.
``@grafana/schema`` and ``typescript`` are installed with npm into a cache directory
(``SIGHTLINE_NPM_CACHE``, default ``~/.cache/sightline/grafana-schema``) on first use.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from sightline.dashboards import build, panels

SCHEMA_PACKAGE = "@grafana/schema@13.2.3"
TYPESCRIPT_PACKAGE = "typescript@7.0.2"

_PRELUDE = """import type { Dashboard } from '@grafana/schema';
// JSON spells enum members as their string values.
type Json<T> = T extends string ? `${T}` : T extends (infer U)[] ? Json<U>[]
  : T extends object ? { [K in keyof T]: Json<T[K]> } : T;
interface ImportInput { name: string; label: string; description: string; type: 'datasource';
  pluginId: string; pluginName: string }
type Exported = Json<Dashboard> & { __inputs: ImportInput[] };
"""


@pytest.fixture(scope="module")
def schema_dir() -> Path:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        pytest.skip("node and npm are needed to install @grafana/schema")
    cache = Path(os.environ.get("SIGHTLINE_NPM_CACHE", Path.home() / ".cache" / "sightline" / "grafana-schema"))
    stamp = cache / "installed.txt"
    wanted = f"{SCHEMA_PACKAGE} {TYPESCRIPT_PACKAGE}"
    if not stamp.is_file() or stamp.read_text() != wanted:
        cache.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([npm, "install", "--prefix", str(cache), "--no-audit", "--no-fund", SCHEMA_PACKAGE,
                               TYPESCRIPT_PACKAGE], capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            pytest.skip(f"npm could not install {wanted}: {done.stderr.strip()[-500:]}")
        stamp.write_text(wanted)
    return cache


def _type_check(schema_dir: Path, documents: dict[str, dict]) -> subprocess.CompletedProcess:
    run = schema_dir / "runs" / uuid.uuid4().hex  # under the cache so that node_modules resolves
    run.mkdir(parents=True)
    try:
        files = []
        for name, document in documents.items():
            path = run / (name.replace("-", "_").removesuffix(".json") + ".ts")
            path.write_text(f"{_PRELUDE}const dashboard: Exported = {json.dumps(document, indent=1)};\n"
                            "export default dashboard;\n")
            files.append(str(path))
        return subprocess.run([str(schema_dir / "node_modules" / ".bin" / "tsc"), "--noEmit", "--strict",
                               "--target", "es2020", "--module", "esnext", "--moduleResolution", "bundler",
                               *files], capture_output=True, text=True, timeout=300, cwd=run)
    finally:
        shutil.rmtree(run, ignore_errors=True)


def _committed() -> dict[str, dict]:
    return {path.name: json.loads(path.read_text()) for path in sorted(build.DEFAULT_OUT.glob("*.json"))}


def test_every_dashboard_matches_grafanas_schema(schema_dir):
    result = _type_check(schema_dir, _committed())
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_check_fails_on_fields_the_schema_does_not_have(schema_dir):
    documents = _committed()
    overview = documents["sightline-overview.json"]
    bad = {
        "null-options": {**overview, "panels": [{**overview["panels"][1], "options": None}]},
        "interval-fields-on-a-query-variable": {**overview, "templating": {"list": [
            {**overview["templating"]["list"][1], "auto": False, "auto_count": 30, "auto_min": "10s"}]}},
        "unknown-panel-field": {**overview, "panels": [{**overview["panels"][1], "bogus": 1}]},
    }
    for name, document in bad.items():
        result = _type_check(schema_dir, {name: document})
        assert result.returncode != 0, name
    result = _type_check(schema_dir, {"all": bad["interval-fields-on-a-query-variable"]})
    assert "'auto'" in result.stdout or '"auto"' in result.stdout, result.stdout


def test_every_query_is_bound_through_the_datasource_variable():
    ref = {"type": "prometheus", "uid": f"${{{panels.DATASOURCE_VARIABLE}}}"}
    for name, document in _committed().items():
        assert panels.PROMETHEUS_DATASOURCE_UID not in json.dumps(document), name
        variables = document["templating"]["list"]
        source = variables[0]
        assert source["type"] == "datasource" and source["name"] == panels.DATASOURCE_VARIABLE
        assert source["query"] == "prometheus"
        assert [i["name"] for i in document["__inputs"]] == [panels.DATASOURCE_INPUT]
        assert all(v["datasource"] == ref for v in variables[1:]), name
        for panel in document["panels"]:
            if panel["type"] == "row":
                continue
            assert panel["datasource"] == ref, (name, panel["title"])
            assert all(target["datasource"] == ref for target in panel["targets"]), (name, panel["title"])


def test_importing_into_another_datasource_binds_every_panel_to_it():
    """What Grafana's import dialog does: the chosen datasource's uid replaces the input."""
    for name, document in _committed().items():
        imported = json.loads(json.dumps(document).replace(f"${{{panels.DATASOURCE_INPUT}}}", "their-prom-uid"))
        current = imported["templating"]["list"][0]["current"]
        assert current["value"] == "their-prom-uid", name
        text = json.dumps(imported)
        assert "DS_PROMETHEUS}" not in text.replace(json.dumps(imported["__inputs"]), "")
