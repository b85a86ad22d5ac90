"""The Grafana dashboard (deploy/grafana/dashboards) is well formed, queries only metrics a real router serves, by
labels they have, and docker-compose.yml provisions it over its own Prometheus (deploy/grafana/provisioning).

The metric names in the dashboard's PromQL are checked against a live router's /metrics after one request: a
family with samples must serve the very series named (name_total for a counter, name_bucket for a histogram); a
labelled family that has no child yet (the per-key families, before a request with a key) shows only its
`# HELP`/`# TYPE` lines, which are taken as existence, its series named by its type.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from conftest import Server
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.parser import text_string_to_metric_families

from conveyor.router.metrics import Metrics

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PROVISIONING = GRAFANA / "provisioning"
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"

DASHBOARD_FILES = sorted(DASHBOARDS.glob("*.json"))
PANEL_TYPES = {"row", "timeseries", "stat", "gauge"}
GRID_WIDTH = 24
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Labels Prometheus itself adds to every scraped series.
SCRAPE_LABELS = {"job", "instance"}

METRIC = re.compile(r"(?<![A-Za-z0-9_:])conveyor_[A-Za-z0-9_:]*")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
MATCHERS = re.compile(r"\{([^}]*)\}")
MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
VARIABLE = re.compile(r"\$(?:\{([A-Za-z0-9_]+)[^}]*\}|([A-Za-z0-9_]+))")
LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
SERIES_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


# --- the dashboard ---------------------------------------------------------------------------------------------


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def all_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, those inside collapsed rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


@dataclass(frozen=True)
class Query:
    where: str
    expr: str
    legend: str = ""


def queries(dashboard: dict) -> list[Query]:
    """Every PromQL expression: the panels' targets and the query variables."""
    found = [
        Query(
            f"{dashboard['title']}: panel {panel['id']} {panel['title']!r} {target['refId']}",
            target["expr"],
            target.get("legendFormat", ""),
        )
        for panel in all_panels(dashboard)
        for target in panel.get("targets", [])
    ]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            expr = query if isinstance(query, str) else query["query"]
            found.append(Query(f"{dashboard['title']}: variable {variable['name']}", expr))
    return found


def metric_names(expr: str) -> set[str]:
    """The conveyor_ identifiers of an expression, string literals (label values, regexes) left out."""
    return set(METRIC.findall(STRING.sub('""', expr)))


def grouping_labels(expr: str) -> set[str]:
    """Labels an expression aggregates by (or without)."""
    expr = STRING.sub('""', expr)
    return {label.strip() for group in GROUPING.findall(expr) for label in group.split(",") if label.strip()}


def labels_used(expr: str) -> set[str]:
    """Labels an expression aggregates by or matches on."""
    matchers = MATCHERS.findall(STRING.sub('""', expr))
    return grouping_labels(expr) | {label for m in matchers for label in MATCHER_LABEL.findall(m)}


def target_labels() -> set[str]:
    """The labels deploy/prometheus.yml gives its targets, and those Prometheus adds to every series."""
    scrape = yaml.safe_load(PROMETHEUS.read_text())
    given = {
        label
        for job in scrape["scrape_configs"]
        for group in job["static_configs"]
        for label in group.get("labels", {})
    }
    return given | SCRAPE_LABELS


def test_there_is_a_dashboard() -> None:
    assert DASHBOARD_FILES, f"no dashboard in {DASHBOARDS}"


@pytest.mark.parametrize("path", DASHBOARD_FILES, ids=[p.name for p in DASHBOARD_FILES])
def test_dashboard_is_well_formed(path: Path) -> None:
    dashboard = load(path)
    assert dashboard["uid"] and dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41, f"schemaVersion {dashboard['schemaVersion']}"
    panels = list(all_panels(dashboard))
    ids = [panel["id"] for panel in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), f"panel ids not unique: {ids}"
    placed: list[tuple[str, dict]] = []
    for panel in panels:
        where = f"{path.name}: panel {panel['id']} {panel.get('title')!r}"
        assert panel["type"] in PANEL_TYPES, f"{where}: type {panel['type']}"
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in "hwxy"), f"{where}: gridPos {grid}"
        assert grid["h"] > 0 and grid["w"] > 0 and grid["x"] >= 0 and grid["y"] >= 0, f"{where}: gridPos {grid}"
        assert grid["x"] + grid["w"] <= GRID_WIDTH, f"{where}: gridPos {grid} is wider than the grid"
        for other, o in placed:
            apart = grid["x"] + grid["w"] <= o["x"] or o["x"] + o["w"] <= grid["x"]
            apart = apart or grid["y"] + grid["h"] <= o["y"] or o["y"] + o["h"] <= grid["y"]
            assert apart, f"{where} overlaps {other}"
        placed.append((where, grid))
        if panel["type"] == "row":
            assert grid["w"] == GRID_WIDTH and grid["h"] == 1, f"{where}: a row spans the grid"
            continue
        assert panel["datasource"] == DATASOURCE, f"{where}: datasource {panel['datasource']}"
        targets = panel["targets"]
        assert targets, f"{where}: no query"
        refs = [target["refId"] for target in targets]
        assert len(set(refs)) == len(refs), f"{where}: refIds {refs}"
        for target in targets:
            assert target["datasource"] == DATASOURCE, f"{where} {target['refId']}: datasource"
            assert metric_names(target["expr"]), f"{where} {target['refId']}: no conveyor_ metric in {target['expr']}"

    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    datasource = variables["datasource"]
    assert datasource["type"] == "datasource" and datasource["query"] == "prometheus"
    for query in queries(dashboard):
        for match in VARIABLE.finditer(query.expr):
            name = match.group(1) or match.group(2)
            assert name.startswith("__") or name in variables, f"{query.where}: ${name} is not a variable"
        # A legend names labels the result has: those the expression groups by.
        legend = set(LEGEND_LABEL.findall(query.legend))
        assert legend <= grouping_labels(query.expr) - {"le"}, f"{query.where}: legend {query.legend!r}"


# --- the metrics a router serves -------------------------------------------------------------------------------


@dataclass
class Family:
    type: str
    series: set[str]  # names of the samples served
    labels: set[str]  # label names of those samples

    def declared_series(self, name: str) -> set[str]:
        return {name + suffix for suffix in SERIES_SUFFIXES.get(self.type, ("",))}


def scrape(server: Server) -> dict[str, Family]:
    families: dict[str, Family] = {}
    text = httpx.get(f"{server.url}/metrics", timeout=10.0).text
    for family in text_string_to_metric_families(text):
        served = Family(family.type, {s.name for s in family.samples}, {k for s in family.samples for k in s.labels})
        if not family.samples:  # `# HELP` and `# TYPE` only: a labelled family with no child yet
            served.series = served.declared_series(family.name)
        families[family.name] = served
    return families


def declared_labels() -> dict[str, set[str]]:
    """Label names of each family the router declares, for families that have no child yet to show them."""
    collectors = [c for c in vars(Metrics()).values() if isinstance(c, MetricWrapperBase)]
    return {c._name: set(c._labelnames) for c in collectors}


def test_dashboard_queries_metrics_the_router_serves(server: Server) -> None:
    response = httpx.post(
        f"{server.url}/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2}}, timeout=60.0
    )
    assert response.status_code == 200, response.text
    families = scrape(server)
    family_of = {name: base for base, family in families.items() for name in family.series}
    declared = declared_labels()
    known = target_labels()
    used: set[str] = set()
    for path in DASHBOARD_FILES:
        for query in queries(load(path)):
            names = metric_names(query.expr)
            used |= names
            missing = sorted(names - family_of.keys())
            assert not missing, f"{path.name}: {query.where}: {missing} not in the router's /metrics"
            labels = set(known)
            for name in names:
                base = family_of[name]
                labels |= families[base].labels or declared.get(base, set())
                if name.endswith("_bucket"):
                    labels.add("le")
            unknown = sorted(labels_used(query.expr) - labels)
            assert not unknown, f"{path.name}: {query.where}: no label {unknown} on {sorted(names)}"
    assert used, "the dashboards query no conveyor_ metric"


# --- provisioning ----------------------------------------------------------------------------------------------


def compose_service(name: str) -> dict:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    assert name in services, f"docker-compose.yml has no {name} service"
    return services[name]


def mounts(service: dict) -> dict[Path, tuple[str, str]]:
    """Bind mounts in short syntax: host path (resolved from the compose file's folder) -> (target, mode)."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        if source.startswith("."):
            found[(ROOT / source).resolve()] = (target, mode[0] if mode else "rw")
    return found


def provisioning(kind: str) -> list[dict]:
    files = sorted((PROVISIONING / kind).glob("*.y*ml"))
    assert files, f"no provisioning file in {PROVISIONING / kind}"
    return [yaml.safe_load(path.read_text()) for path in files]


def test_compose_provisions_grafana() -> None:
    grafana, prometheus = compose_service("grafana"), compose_service("prometheus")
    image, _, tag = grafana["image"].partition(":")
    assert image == "grafana/grafana-oss" and re.fullmatch(r"\d+\.\d+\.\d+", tag), f"a pinned tag: {grafana['image']}"
    assert grafana.get("profiles") == prometheus.get("profiles"), "Grafana comes up with the Prometheus it reads"
    for port in grafana.get("ports", []):
        assert str(port).startswith("127.0.0.1:"), f"grafana publishes {port} beyond this machine"

    mounted = mounts(grafana)
    assert mounted.get(PROVISIONING) == ("/etc/grafana/provisioning", "ro"), f"grafana mounts {mounted}"
    assert DASHBOARDS in mounted and mounted[DASHBOARDS][1] == "ro", f"grafana mounts {mounted}"
    dashboards_path = mounted[DASHBOARDS][0]

    providers = [p for doc in provisioning("dashboards") for p in doc["providers"]]
    assert any(p["type"] == "file" and p["options"]["path"] == dashboards_path for p in providers), (
        f"no dashboard provider loads {dashboards_path}, where {DASHBOARDS.relative_to(ROOT)} is mounted"
    )
    home = grafana.get("environment", {}).get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home is not None:
        assert home.startswith(dashboards_path + "/") and (DASHBOARDS / home[len(dashboards_path) + 1 :]).is_file()

    # The dashboards' datasource variable defaults to the provisioned Prometheus, at the compose service.
    (source,) = [s for doc in provisioning("datasources") for s in doc["datasources"] if s["type"] == "prometheus"]
    for path in DASHBOARD_FILES:
        (variable,) = [v for v in load(path)["templating"]["list"] if v["name"] == "datasource"]
        assert variable["current"]["value"] == source["uid"], f"{path.name}: the datasource variable's default"
    url = urlsplit(source["url"])
    assert compose_service(url.hostname)["image"].startswith("prom/prometheus:"), f"{source['url']}: not Prometheus"
    container_ports = {int(str(p).rsplit(":", 1)[1]) for p in compose_service(url.hostname).get("ports", [])}
    assert url.port in container_ports, f"{source['url']}: Prometheus listens on {sorted(container_ports)}"
    depends = grafana.get("depends_on", [])
    assert url.hostname in depends, "grafana depends on the Prometheus it reads"
