"""The benchmark reads the router's Server-Timing header as the router writes it."""

from __future__ import annotations

from infra.wire import parse_server_timing
from router.stream import Settlement
from tests.unit.router_harness import TENANTS


def test_the_header_the_router_writes_parses_back():
    s = Settlement(TENANTS[0], None, None, None, None, received=1.0)
    s.marks = {"sent": 1.002, "arrived": 1.009, "admitted": 1.009, "first": 1.061}
    assert parse_server_timing(s.server_timing()) == {"router": 2.0, "reach": 7.0, "queue": 0.0, "engine": 52.0}
    s.marks = {"sent": 1.004}  # no replica answered: only the steps that happened
    assert parse_server_timing(s.server_timing()) == {"router": 4.0}


def test_entries_without_a_duration_and_garbage_are_left_out():
    assert parse_server_timing("") == {}
    assert parse_server_timing('cache;desc="hit", db;dur=53.2, bad;dur=x, total;desc=t;dur=7') == {"db": 53.2, "total": 7.0}
