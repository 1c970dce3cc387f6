"""The committed benchmark results are whole, and docs/benchmarks.md is what they render to."""

from __future__ import annotations

import importlib
import json
import re

from bench import report, verdicts

RESULTS = report.RESULTS


def test_every_overhead_verdict_is_recomputed_from_the_committed_raw_data():
    d = report.load("overhead")
    assert d["setup"]["prompts"] == [128, 1024, 4096] and d["setup"]["rounds"] >= 3
    raw = RESULTS / "raw" / d["run"]
    assert {r["router_prompt_tokens"] >= 4096 for r in verdicts.overhead_pairs(raw) if r["prompt"] == 4096} == {True}
    found = verdicts.overhead_findings(d, raw)
    assert len(found) == 4 and all(f.interval is not None for f in found)
    doc = report.DOC.read_text()
    for f in found:
        assert f.row() in doc, f.target.name


def test_overhead_findings_follow_the_paired_differences(tmp_path):
    """Synthetic raw data with a known answer: 3 ms added at 128 tokens, 30 ms at 4,096, and
    the router path at half the direct path's req/s."""
    import gzip

    rows = [{"round": k, "prompt": p, "first": "router", "router_ttft_ms": 50.0 + add + (i % 3),
             "direct_ttft_ms": 50.0 + (i % 3), "router_prompt_tokens": p, "direct_prompt_tokens": p,
             "router_steps_ms": {"router": 1.0}} for k in range(3) for p, add in ((128, 3.0), (4096, 30.0))
            for i in range(10)]
    with gzip.open(tmp_path / "pairs.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    order = ["router", "direct", "direct", "router", "router", "direct"]
    for i, path in enumerate(order):
        n = 5 if path == "router" else 10  # completed in the 1-s window
        results = [{"start": 100.0 + j / 100, "status": 200, "ttft": 0.01, "e2e": 0.05} for j in range(n)]
        with gzip.open(tmp_path / f"loop-{i:02d}-{path}.jsonl.gz", "wt") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
        (tmp_path / f"loop-{i:02d}-{path}.json").write_text(json.dumps({"window": {"from": 100.0, "seconds": 1.0}}))
    d = {"setup": {"prompts": [128, 4096], "concurrency": 8}, "loop_order": order}
    small, large, rps = verdicts.overhead_findings(d, tmp_path)
    assert (small.interval.value, small.verdict) == (3.0, "met")
    assert (large.interval.value, large.verdict) == (30.0, "missed")
    assert (rps.interval.value, rps.verdict, rps.runs) == (0.5, "missed", (3, 3))


def test_autoscale_result_holds_its_rounds():
    a = report.load("autoscale")
    runs = {w: sum(r["way"] == w for r in a["rounds"]) for w in ("autoscaled", "static-low", "static-high")}
    assert min(runs.values()) >= 3 and a["order"] == [r["way"] for r in a["rounds"]], runs
    assert a["setup"]["safe_range"][0] in {v for r in a["rounds"] if r["way"] == "autoscaled" for _, v in r["limits"]}


def test_benchmarks_doc_is_rendered_from_the_committed_results():
    doc = report.DOC.read_text()
    assert doc == report.render(), "run `python -m bench.report`"


def test_the_doc_says_whether_its_sections_come_from_one_make_bench_run():
    runs = {"ceiling": {"run": "c1"}, "autoscale": {"run": "a1"}, "overhead": {"run": "o1"}}
    ran = {"wall_s": 2400, "machine": {"when": "2026-12-03 14:00:00 UTC"}, "ceiling": "c1", "autoscale": "a1",
           "overhead": "o1"}
    assert "sections below come from one `make bench` run (2,400 s" in report._provenance(ran, runs)[0]
    for other in (None, {**ran, "overhead": "o0"}):  # no record, or one benchmark run again since
        assert "separate runs" in report._provenance(other, runs)[0]
    assert report._provenance(ran, {"ceiling": None}) == []


def test_every_flood_round_schedules_at_least_300_online_requests():
    """Issue 20's floor for a P99 under the flood, with the seed the online load generator uses."""
    import random

    from bench.ceiling import FLOOD_S, ONLINE_RATE, ONLINE_SEED
    from infra.traffic import poisson_arrivals

    assert len(poisson_arrivals(ONLINE_RATE, FLOOD_S, random.Random(ONLINE_SEED))) >= 300


def test_every_ceiling_verdict_is_recomputed_from_the_committed_raw_data():
    d = report.load("ceiling")
    raw = RESULTS / "raw" / d["run"]
    assert (raw / "partial.json").exists(), "a run's record stays beside its raw data"
    found = verdicts.findings(d, raw)
    assert found, "the committed run holds at least one target"
    doc = report.DOC.read_text()
    for f in found:
        assert f.row() in doc, f.target.name


def test_every_autoscale_verdict_is_recomputed_from_the_committed_raw_data():
    d = report.load("autoscale")
    found = verdicts.autoscale_findings(d, RESULTS / "raw" / d["run"])
    assert len(found) == 3 * len(d["setup"]["phases"])  # goodput, P99 TTFT, P99 TPOT in every phase
    doc = report.DOC.read_text()
    for f in found:
        assert f.row() in doc, f.target.name


def test_the_plots_the_doc_shows_are_committed():
    images = re.findall(r"!\[[^]]*\]\((images/[^)]+)\)", report.DOC.read_text())
    assert len(images) == 2
    assert all((report.DOC.parent / path).is_file() for path in images)


def test_make_bench_entry_point_and_its_benchmarks_import():
    run_all = importlib.import_module("bench.run_all")  # `make bench` runs its main
    assert callable(run_all.main)
    used = {"autoscale": ("run",), "overhead": ("run", "deployed"), "ceiling": ("main",)}
    for module, names in used.items():
        m = importlib.import_module(f"bench.{module}")
        assert all(callable(getattr(m, n)) for n in names), module


def test_ceiling_result_keeps_its_raw_data_in_the_repository():
    d = report.load("ceiling")
    raw = RESULTS / "raw" / d["run"]
    assert raw.is_dir() and {r["path"] for r in d["ceiling"]} >= {"raw-engine", "vllm-server", "poolserve"}
    assert all(r["output_tok_s"] > 0 for r in d["ceiling"])
    for path in d.get("profiles", {}).values():  # kept relative to the repository, so a clone finds them
        assert not path.startswith("/") and (report.RESULTS.parents[1] / path).is_file(), path


def test_ceiling_section_names_the_flood_only_when_the_run_had_one():
    from bench.report_ceiling import ceiling_section

    run = {"run": "r", "wall_s": 1.0, "flood": [], "c1": [], "ceiling_order": ["raw-engine", "poolserve"],
           "ceiling": [{"path": "raw-engine", "output_tok_s": 200.0},
                       {"path": "poolserve", "output_tok_s": 100.0, "cpu_s_per_1k_tokens": {"router": 0.5}}]}
    text = "\n".join(ceiling_section(run, "machine"))
    assert "no flood rounds" in text and "under a batch flood" not in text
    assert "| poolserve | 100 | 0.50x [0.50–0.50] | 0.50 | router 0.50 |" in text
    flood = {"setup": "poolserve", "online_ttft_ms": {"p99": 10, "p50": 5}, "online_tpot_ms": {"p99": 2},
             "online_errors": 0, "offline_tok_s": 50, "cpu_s": {"router": 1.0}, "window_s": 10}
    text = "\n".join(ceiling_section({**run, "flood": [flood, {**flood, "setup": "stock-two-pools"}]}, "machine"))
    assert "under a batch flood" in text and "| online TTFT P99 (ms) | 10 | 10 | 1.00x [1.00–1.00] |" in text


def test_ceiling_compresses_only_the_large_raw_files(tmp_path):
    import gzip

    from bench.common import compress

    (tmp_path / "big.json").write_text("x" * 100)
    (tmp_path / "small.json").write_text("y")
    renamed = compress(tmp_path, above=10, root=tmp_path.parent)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.json.gz", "small.json"]
    # the run records its profiles under these names (a profile past the bound once went missing)
    assert renamed == {f"{tmp_path.name}/big.json": f"{tmp_path.name}/big.json.gz"}
    assert gzip.decompress((tmp_path / "big.json.gz").read_bytes()) == b"x" * 100


def test_no_ceiling_path_sends_the_prompts_of_one_of_its_rounds_again():
    """An engine that stays up between rounds kept the prompts of its earlier rounds in its
    prefix cache, where the raw engine starts afresh each round: every round of a path gets
    prompts of its own, and the k-th rounds of all paths the same ones."""
    ceiling = importlib.import_module("bench.ceiling")
    order = ["raw-engine", "poolserve", "poolserve", "batch-job", "raw-engine", "poolserve", "batch-job"]
    seeds = ceiling.round_seeds(order)
    by_path: dict[str, list[int]] = {}
    for path, seed in zip(order, seeds):
        by_path.setdefault(path, []).append(seed)
    assert by_path == {"raw-engine": [0, 1], "poolserve": [0, 1, 2], "batch-job": [0, 1]}
    # a baseline's two arms are one engine: vLLM's server, free then bound, never gets a round's prompts twice
    assert ceiling.round_seeds(["vllm-server", "vllm-server-bound", "poolserve", "vllm-server-bound"]) == [0, 1, 0, 2]


def test_a_ceiling_run_of_some_parts_stays_out_of_the_doc(monkeypatch):
    """The doc's tables read bench/results/ceiling.json: a development run of one part must not
    replace the whole run there."""
    ceiling = importlib.import_module("bench.ceiling")
    ran, wrote = [], []
    monkeypatch.setattr(ceiling, "run", lambda rounds, c_rounds, seed, parts, results: ran.append((parts, results)))
    monkeypatch.setattr(ceiling, "write_result", lambda name, result, results: wrote.append((name, results)))
    ceiling.main(["--only", "c1"])
    ceiling.main(["--only", "c1", "--only", "flood"])
    ceiling.main(["--only", "c1", "--only", "ceiling", "--only", "flood"])
    ceiling.main([])
    quick = ceiling.RESULTS / "quick"
    assert ran == [(("c1",), quick), (("flood", "c1"), quick), (ceiling.PARTS, ceiling.RESULTS),
                   (ceiling.PARTS, ceiling.RESULTS)]
    assert wrote == [("ceiling", results) for _, results in ran]


def test_each_baseline_arm_is_a_column_and_the_raw_engine_ratio_takes_the_stronger():
    """A baseline measured with its engine core free and bound: the flood shows both arms beside
    poolserve, and the ceiling's ratio to the raw engine is to its faster arm."""
    from bench.report_ceiling import ceiling_section

    flood = {"setup": "poolserve", "online_ttft_ms": {"p99": 10, "p50": 5}, "online_tpot_ms": {"p99": 2},
             "online_errors": 0, "offline_tok_s": 50, "cpu_s": {"router": 1.0}, "window_s": 10}
    run = {"run": "r", "wall_s": 1.0, "c1": [], "ceiling_order": ["raw-engine", "raw-engine-bound", "poolserve"],
           "flood": [flood, {**flood, "setup": "stock-two-pools", "offline_tok_s": 25},
                     {**flood, "setup": "stock-two-pools-bound", "offline_tok_s": 100}],
           "ceiling": [{"path": "raw-engine", "output_tok_s": 200.0},
                       {"path": "raw-engine-bound", "output_tok_s": 400.0},
                       {"path": "poolserve", "output_tok_s": 100.0, "cpu_s_per_1k_tokens": {"router": 0.5}}]}
    text = "\n".join(ceiling_section(run, "machine"))
    assert ("| metric | poolserve | stock two pools | stock two pools, engine cores bound | "
            "poolserve / stock two pools | poolserve / stock two pools, engine cores bound |") in text
    assert "| offline tok/s | 50 | 25 | 100 | 2.00x [2.00–2.00] | 0.50x [0.50–0.50] |" in text
    assert "| poolserve | 100 | 0.25x [0.25–0.25] |" in text
    assert "`-bound` is that baseline with its engine core bound" in text


def test_a_baseline_s_name_says_its_arm():
    from bench.setups import arm

    assert arm("vllm-server") == ("vllm-server", "free")
    assert arm("vllm-server-bound") == ("vllm-server", "bound")
    assert arm("stock-two-pools-bound") == ("stock-two-pools", "bound")
