"""The side-by-side comparison of the load generator and `vllm bench serve`."""

import pytest

from bench.agreement import Timing, compare, vllm_timings


def test_only_requests_inside_the_shared_window_count():
    ours = [Timing(0.0, 0.5, 1.5, 11),  # before vLLM began: left out
            Timing(10.0, 0.1, 1.1, 11), Timing(11.0, 0.3, 1.3, 11),
            Timing(19.5, 0.9, 1.9, 11)]  # ends after vLLM's last: left out
    theirs = [Timing(10.0, 0.2, 1.2, 11), Timing(12.0, 0.2, 1.2, 6), Timing(19.0, 0.2, 1.2, 11)]
    out = compare(ours, theirs)
    assert out["overlap_s"] == pytest.approx(10.2)
    assert out["ours"] == {"n": 2, "ttft_ms": pytest.approx(200), "tpot_ms": pytest.approx(100)}
    assert out["vllm"]["n"] == 3 and out["vllm"]["ttft_ms"] == pytest.approx(200)
    assert out["vllm"]["tpot_ms"] == pytest.approx(100)  # (1.2 - 0.2) / 10 twice, / 5 once
    assert out["relative_difference"]["ttft_ms"] == pytest.approx(0.0)


def test_difference_is_relative_to_vllm():
    ours = [Timing(0.0, 0.12, 1.0, 11)]
    theirs = [Timing(0.0, 0.10, 1.0, 11)]
    assert compare(ours, theirs)["relative_difference"]["ttft_ms"] == pytest.approx(0.2)


def test_single_token_outputs_have_no_tpot():
    out = compare([Timing(0.0, 0.1, 0.1, 1)], [Timing(0.0, 0.1, 0.1, 1)])
    assert out["ours"]["tpot_ms"] is None and out["relative_difference"]["tpot_ms"] is None


def test_nothing_to_compare_is_an_error():
    with pytest.raises(ValueError, match="both tools"):
        compare([], [Timing(0.0, 0.1, 1.0, 2)])


def test_vllm_detailed_result_becomes_timings_without_failures():
    result = {"start_times": [1.0, 2.0], "ttfts": [0.1, 0.0], "itls": [[0.05, 0.05], []],
              "output_lens": [3, 0], "errors": ["", "HTTP 500"]}
    (t,) = vllm_timings(result)
    assert t.start == 1.0 and t.e2e == pytest.approx(0.2) and t.tpot == pytest.approx(0.05)
