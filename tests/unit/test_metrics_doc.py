"""docs/metrics.md lists every series poolserve exports, as `infra.metrics` declares them, and
the Grafana dashboard queries only those (the live series are checked by
tests/integration/test_metrics.py)."""

from __future__ import annotations

import json
import re

from deployments.dashboard import dashboard
from deployments.metrics_doc import DOC, GROUPS, render
from infra.metrics import SERIES


def test_the_metrics_doc_is_the_one_the_series_make():
    assert DOC.read_text() == render(), "run `python -m deployments.config_doc`"


def test_every_series_is_in_one_process_group_and_documented_once():
    keys = [k for _, group in GROUPS for k in group]
    assert sorted(keys) == sorted(SERIES), "a series no process makes, or one made by two"
    assert all(render().count(f"`ray_{s.name}`") == 1 for s in SERIES.values())
    assert all(s.kind in ("gauge", "counter", "histogram") and bool(s.buckets) == (s.kind == "histogram")
               for s in SERIES.values())


def test_the_dashboard_queries_only_documented_series():
    queried = set(re.findall(r"ray_(poolserve_\w+)", json.dumps(dashboard())))
    names = {s.name for s in SERIES.values()}
    assert queried and {re.sub(r"_(bucket|sum|count)$", "", q) if q not in names else q for q in queried} <= names
