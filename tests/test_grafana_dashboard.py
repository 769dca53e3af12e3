"""cluster/grafana/minilm-dashboard.json: every panel queries gauges the job exports (ray_jobs/dashboard_metrics.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ray_jobs import dashboard_metrics

DASHBOARD = Path(__file__).resolve().parents[1] / "cluster" / "grafana" / "minilm-dashboard.json"
RUN_FILTER = '{run=~"$run"}'


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(panel: dict) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def gauges_in(expr: str) -> list[str]:
    return re.findall(r"\bray_\w+", expr)


def test_every_panel_queries_only_exported_gauges_of_the_selected_runs(dashboard):
    exported = set(dashboard_metrics.metric_names())  # from the module's GAUGES, as Ray names them
    assert dashboard["panels"]
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for expr in queries(panel):
            names = gauges_in(expr)
            assert names, (panel["title"], expr)
            assert set(names) <= exported, (panel["title"], sorted(set(names) - exported))
            # Every selector filters on the run variable, by the tag the gauges carry.
            assert expr.count(RUN_FILTER) == len(names), (panel["title"], expr)
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    assert "run" in dashboard_metrics.TAG_KEYS


def test_the_issue_s_gauges_are_plotted_and_every_exported_gauge_has_a_panel(dashboard):
    plotted = {name for panel in dashboard["panels"] for expr in queries(panel) for name in gauges_in(expr)}
    named_by_issue = ["loss", "tokens_per_s", "mfu", "world_size", "redone_steps", "data_wait_frac"]
    assert {"ray_minilm_" + key for key in named_by_issue} <= plotted
    # A gauge added to dashboard_metrics without a panel fails here: add one.
    assert plotted == set(dashboard_metrics.metric_names())


def test_run_variable_legends_and_datasource(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    run_query = variables["run"]["query"]["query"]
    assert re.fullmatch(r"label_values\((ray_minilm_\w+), run\)", run_query)
    assert gauges_in(run_query)[0] in dashboard_metrics.metric_names()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}"
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}"
            # Legends name only labels the query keeps (max by (run)).
            assert set(re.findall(r"\{\{(\w+)\}\}", target["legendFormat"])) == {"run"}, target


def test_panels_have_unique_ids_and_do_not_overlap(dashboard):
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert dashboard["uid"] and dashboard["title"]
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
