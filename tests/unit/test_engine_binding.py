"""The engine-binding diagnostic's summary, from raw rounds written as a run writes them."""

from __future__ import annotations

import json

from bench import engine_binding


def _round(raw, i: int, arm: str, lines: list[float], late: list[float]) -> dict:
    (raw / f"{i:02d}-{arm}.json").write_text(json.dumps({"lines_s": lines, "heartbeat_late_s": late}))
    return {"round": i, "arm": arm, **engine_binding.summary(lines, late)}


def test_a_stream_that_stalls_reads_as_its_gaps_and_duration(tmp_path):
    smooth = [0.1 * k for k in range(1, 31)]  # 3 s, a line every 100 ms
    stalled = smooth[:10] + [x + 4.0 for x in smooth[10:]]  # one 4.1 s gap
    rounds = [_round(tmp_path, 0, "free", stalled, [0.0, 2.5]), _round(tmp_path, 1, "bound", smooth, [0.0, 0.01]),
              _round(tmp_path, 2, "bound", smooth, [0.02, 0.0]), _round(tmp_path, 3, "free", smooth, [0.0, 0.5])]
    (tmp_path / "results.json").write_text(json.dumps({"seed": 0, "rounds": rounds}))
    s = engine_binding.summarize(tmp_path)
    assert s["per_arm"]["free"] == {"duration_s": [7.0, 3.0], "longest_gap_s": [4.1, 0.1], "gaps_over_300ms": [1, 0],
                                    "heartbeat_worst_late_s": [2.5, 0.5]}
    assert s["per_arm"]["bound"]["longest_gap_s"] == [0.1, 0.1]
    assert s["free_over_bound"]["stream duration"].startswith("1.67 ")  # (7 + 3) / 2 over 3
