"""The mixed benchmark's borrowing verdict: alternating windows averaged, and the target."""

from __future__ import annotations

from bench.mixed import _mean_window, targets


def _window(tok: float, engine: float | None, borrowed: int) -> dict:
    return {"output_tok_s": tok, "req_s": tok / 100, "rejection_rate": 0.0, "error_rate": 0.0,
            "borrowed": borrowed, "engine_output_tok_s": engine}


def test_windows_are_averaged_and_borrowed_requests_summed():
    m = _mean_window([_window(1000, 1100, 2), _window(1200, 1300, 3)])
    assert m["output_tok_s"] == 1100 and m["engine_output_tok_s"] == 1200 and m["borrowed"] == 5
    assert m["windows_engine_output_tok_s"] == [1100, 1300]


def test_a_window_without_an_engine_count_leaves_the_mean_unknown():
    assert _mean_window([_window(1000, None, 0), _window(1200, 1300, 0)])["engine_output_tok_s"] is None


def _results(off: float | None, on: float | None, borrowed: int) -> dict:
    ps = {"offline_alone_no_borrowing": _mean_window([_window(900, off, 0)]),
          "offline_alone": _mean_window([_window(1000, on, borrowed)])}
    return {"poolserve": ps}


RATIOS = {k: None for k in ("online_ttft_p99_vs_single-fcfs", "online_ttft_p99_vs_single-priority",
                            "online_ttft_p99_vs_stock-two-pools", "online_ttft_p99_vs_floor",
                            "online_tpot_p99_vs_single-priority", "offline_tok_s_vs_stock-two-pools")}


def test_borrowing_is_met_only_when_borrowed_work_lifts_the_engines_count():
    key = "borrowing_lifts_offline_alone_above_offline_pool_alone"
    assert targets(_results(1000, 1100, 40), RATIOS)[key]
    assert not targets(_results(1000, 950, 40), RATIOS)[key]
    assert not targets(_results(1000, 1100, 0), RATIOS)[key]  # nothing borrowed: not borrowing's lift
    assert not targets(_results(None, 1100, 40), RATIOS)[key]  # no baseline count: not met
