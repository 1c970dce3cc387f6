"""poolserve's Grafana dashboard (`k8s/dashboards/poolserve.json`, which `poolserve k8s render`
writes): one row per question an operator asks, over Prometheus series Ray exports."""

from __future__ import annotations

PANELS: list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]] = [
    ("Is chat within its SLO?", [
        ("P99 time to first token (at the replica)", "s", [
            ('histogram_quantile(0.99, sum by (le, pool) (rate(ray_poolserve_ttft_seconds_bucket[1m])))', "{{pool}}")]),
        ("P99 time per output token", "s", [
            ('histogram_quantile(0.99, sum by (le, pool) (rate(ray_poolserve_tpot_seconds_bucket[1m])))', "{{pool}}")]),
        ("Requests by status", "reqps", [
            ('sum by (pool, status) (rate(ray_poolserve_router_requests_total[1m]))', "{{pool}} {{status}}")]),
    ]),
    ("How deep are the queues?", [
        ("Queued requests by priority", "short", [
            ('sum by (pool, priority) (ray_poolserve_queue_depth)', "{{pool}} {{priority}}")]),
        ("Queued tokens", "short", [('sum by (pool) (ray_poolserve_queued_tokens)', "{{pool}}")]),
        ("P99 wait at the gate", "s", [
            ('histogram_quantile(0.99, sum by (le, pool, priority) (rate(ray_poolserve_queue_wait_seconds_bucket[1m])))',
             "{{pool}} {{priority}}")]),
    ]),
    ("Where are the limits inside their safe range?", [
        ("Active sequences and limit", "short", [
            ('sum by (pool) (ray_poolserve_active_seqs)', "{{pool}} active"),
            ('sum by (pool) (ray_poolserve_limit_max_active_seqs)', "{{pool}} limit"),
            ('max by (pool) (ray_poolserve_safe_range_low)', "{{pool}} range low"),
            ('max by (pool) (ray_poolserve_safe_range_high)', "{{pool}} range high")]),
        ("KV cache usage", "percentunit", [
            ('max by (pool) (ray_poolserve_kv_usage)', "{{pool}}"),
            ('max by (model_name) (ray_vllm_kv_cache_usage_perc)', "vLLM {{model_name}}")]),
        ("Stale calibration profile", "short", [('max by (pool) (ray_poolserve_profile_stale)', "{{pool}}")]),
    ]),
    ("Who is being throttled?", [
        ("Quota refusals by tenant", "reqps", [
            ('sum by (tenant, limit) (rate(ray_poolserve_quota_rejections_total[5m]))', "{{tenant}} {{limit}}")]),
        ("Tokens per tenant", "short", [
            ('sum by (tenant, kind) (rate(ray_poolserve_tenant_tokens_total[1m]))', "{{tenant}} {{kind}}")]),
        ("Quota left this minute (tokens)", "short", [
            ('min by (tenant) (ray_poolserve_quota_remaining_tokens)', "{{tenant}}")]),
        ("Gate outcomes", "reqps", [
            ('sum by (pool) (rate(ray_poolserve_admitted_total[1m]))', "{{pool}} admitted"),
            ('sum by (pool, reason) (rate(ray_poolserve_rejected_total[1m]))', "{{pool}} rejected {{reason}}"),
            ('sum by (pool, reason) (rate(ray_poolserve_shed_total[1m]))', "{{pool}} shed by the router {{reason}}"),
            ('sum by (pool) (rate(ray_poolserve_cancelled_total[1m]))', "{{pool}} cancelled"),
            ('sum by (pool, into) (rate(ray_poolserve_borrowed_total[1m]))', "{{pool}} borrowed into {{into}}")]),
    ]),
    ("Why did the autoscaler move?", [
        ("Autoscaler decisions by reason", "short", [
            ('sum by (pool, action, reason) (increase(ray_poolserve_autoscale_decisions_total[5m]))',
             "{{pool}} {{action}} {{reason}}")]),
        ("Autoscaler target", "short", [('max by (pool) (ray_poolserve_autoscale_target_seqs)', "{{pool}}")]),
        ("Engine: running and waiting", "short", [
            ('sum by (pool) (ray_poolserve_engine_running)', "{{pool}} running"),
            ('sum by (pool) (ray_poolserve_engine_waiting)', "{{pool}} waiting")]),
        ("vLLM output tokens/s", "short", [('sum(rate(ray_vllm_generation_tokens_total[1m]))', "all engines")]),
    ]),
]


def dashboard() -> dict:
    panels, y, pid = [], 0, 1
    for row_title, row in PANELS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        width = 24 // len(row)
        for i, (title, unit, targets) in enumerate(row):
            panels.append({
                "id": pid, "type": "timeseries", "title": title,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": 8, "w": width, "x": i * width, "y": y},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
                "targets": [{"refId": chr(65 + j), "expr": expr, "legendFormat": legend,
                             "datasource": {"type": "prometheus", "uid": "${datasource}"}}
                            for j, (expr, legend) in enumerate(targets)],
            })
            pid += 1
        y += 8
    return {
        "uid": "poolserve", "title": "poolserve", "tags": ["poolserve", "ray", "vllm"], "schemaVersion": 39,
        "version": 1, "editable": True, "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "timezone": "browser", "graphTooltip": 1,
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus"}]},
        "annotations": {"list": []},
        "panels": panels,
    }
