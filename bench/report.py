"""Write docs/benchmarks.md (tables, plots, targets) from bench/results/*.json.

    python -m bench.report
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from bench import verdicts
from bench.common import REPO, RESULTS
from bench.report_ceiling import ceiling_section

DOC = REPO / "docs" / "benchmarks.md"
IMAGES = REPO / "docs" / "images"


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _f(x, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _yes(ok: bool) -> str:
    return "**met**" if ok else "**missed**"


def _machine(d: dict) -> str:
    m = d["machine"]
    return (f"Measured {m['when']} on {m['hardware']} ({m['cores']} cores), Python {m['python']}, "
            f"Ray {m['ray']}, vLLM {m['vllm']}.")


def plot_overhead(d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    metrics = [("ttft", "p50"), ("ttft", "p99"), ("e2e", "p50"), ("e2e", "p99")]
    labels = [f"{m} {p}" for m, p in metrics]
    x = range(len(metrics))
    ax.bar([i - 0.2 for i in x], [d["direct"][f"{m}_ms"][p] for m, p in metrics], 0.4, label="direct (stock ingress)")
    ax.bar([i + 0.2 for i in x], [d["router"][f"{m}_ms"][p] for m, p in metrics], 0.4, label="through the router")
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("ms")
    ax.set_title(f"Router overhead (req/s ratio {d['req_per_s_ratio']:.2f})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_autoscale(d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = verdicts.autoscale_figures(d, RESULTS / "raw" / d["run"])
    ways, phases = list(figures), [p for p, _, _ in d["setup"]["phases"]]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(ways)
    for ax, metric, label in ((axes[0], "goodput", "requests within SLO (share of sent)"),
                              (axes[1], "P99 TTFT", "online P99 TTFT (ms, log)")):
        for k, w in enumerate(ways):
            ivs = [figures[w][p][metric] for p in phases]
            xs = [i + (k - (len(ways) - 1) / 2) * width for i in range(len(phases))]
            values = [iv.value if iv else 0.0 for iv in ivs]
            errs = [[iv.value - iv.lo if iv else 0.0 for iv in ivs], [iv.hi - iv.value if iv else 0.0 for iv in ivs]]
            ax.bar(xs, values, width, yerr=errs, capsize=3, label=w)
        ax.set_xticks(range(len(phases)), phases)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    axes[1].set_yscale("log")
    fig.suptitle(f"Load step on the online pool, {d['setup']['runs']} runs a way (bars: 95% intervals)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def overhead_section(d: dict) -> list[str]:
    r, dr, a, lat = d["router"], d["direct"], d["added_at_load"], d["latency_one_at_a_time"]
    return [
        "## Router overhead (`bench/overhead.py`)", "",
        f"The baseline is {d['setup']['baseline']} on the same core. {_machine(d)}", "",
        f"**Latency**, one request at a time, the paths alternating request by request, {lat['pairs']} pairs of "
        f"{lat['lengths']} tokens: TTFT p50 {_f(lat['ttft_p50_ms']['router'], 1)} ms through the router, "
        f"{_f(lat['ttft_p50_ms']['direct'], 1)} ms direct: **{_f(lat['added_ttft_p50_ms'], 1)} ms added** "
        f"(median of the pairs' differences {_f(lat['median_pair_difference_ms'], 1)} ms).", "",
        *_steps(lat.get("router_path_steps_p50_ms")),
        f"**Throughput**, {d['setup']['concurrency']} concurrent streams, {d['setup']['lengths']} tokens, "
        f"{d['setup']['rounds']} alternating rounds of {d['setup']['measure_s_per_round']} s per path:", "",
        "| path | req/s | TTFT p50 / p99 (ms) | E2E p50 / p99 (ms) | TPOT p50 (ms) |", "|---|---:|---:|---:|---:|",
        f"| direct | {_f(dr['req_per_s'], 2)} | {_f(dr['ttft_ms']['p50'])} / {_f(dr['ttft_ms']['p99'])} | "
        f"{_f(dr['e2e_ms']['p50'])} / {_f(dr['e2e_ms']['p99'])} | {_f(dr['tpot_ms']['p50'], 1)} |",
        f"| router | {_f(r['req_per_s'], 2)} | {_f(r['ttft_ms']['p50'])} / {_f(r['ttft_ms']['p99'])} | "
        f"{_f(r['e2e_ms']['p50'])} / {_f(r['e2e_ms']['p99'])} | {_f(r['tpot_ms']['p50'], 1)} |", "",
        f"At that load the difference in TTFT p50 was {_f(a['ttft_p50_ms'], 1)} ms (E2E {_f(a['e2e_p50_ms'], 1)} ms), "
        f"within the swings of two shared cores; req/s ratio {_f(d['req_per_s_ratio'], 2)}. Targets: at most 5 ms "
        f"added at p50 ({_yes(d['met']['added_ttft_p50'])}), at least 0.9x the direct req/s "
        f"({_yes(d['met']['req_per_s_ratio'])}).", "",
        "![overhead](images/bench-overhead.png)", "",
    ]


def _steps(steps: dict | None) -> list[str]:
    if not steps:
        return []
    return ["Where the router path's TTFT went (P50 of each step, ms, from the router's `Server-Timing` header): "
            + ", ".join(f"{k} {_f(v, 1)}" for k, v in steps.items()) + ". The direct path has no such split; "
            "its own ingress and proxy hops are inside its total.", ""]


def autoscale_section(d: dict) -> list[str]:
    s, raw = d["setup"], RESULTS / "raw" / d["run"]
    figures, requests = verdicts.autoscale_figures(d, raw), verdicts.autoscale_requests(d, raw)
    rates, seconds = {name: rate for name, rate, _ in s["phases"]}, {name: sec for name, _, sec in s["phases"]}
    lines = [
        "## Autoscaler (`bench/autoscale.py`)", "",
        f"Pool `{s['pool']}`, safe range {s['safe_range']}, SLO P99 TTFT {s['slo']['ttft_p99_ms']:.0f} ms / TPOT "
        f"{s['slo']['tpot_p99_ms']:.0f} ms; Poisson chat with trace lengths; one load step, phases (name, req/s, "
        f"seconds) {s['phases']}, each phase starting as the one before ends; autoscaler {s['autoscale']}. The "
        f"autoscaled way starts at the bottom of the range. {s['runs']} runs of each way, interleaved in the order "
        f"{', '.join(d['order'])} (seed {d['seed']}); the k-th run of every way has the same arrival times. A request "
        f"with no answer after {s['timeout_s']} s, or {s['drain_s']} s after its phase, is cancelled and counts "
        f"with its wait as its TTFT (a lower bound). Every figure is over all runs, with its 95% bootstrap interval "
        f"over runs and requests, computed from the raw data in `bench/results/raw/{d['run']}/`. {_machine(d)}", "",
        "| way | phase | within SLO, share of sent | goodput req/s | P99 TTFT (ms) | P99 TPOT (ms) | "
        "answered / sent | limit in the phase |", "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    starts = dict(zip(rates, itertools.accumulate([0] + [sec for _, _, sec in s["phases"]])))
    for way, phases in figures.items():
        rounds = [r for r in d["rounds"] if r["way"] == way]
        for phase, m in phases.items():
            runs = requests[way][phase]
            sent, answered = sum(map(len, runs)), sum(r.ok for rs in runs for r in rs)
            good = sum(verdicts.within_slo(r, s["slo"]) for rs in runs for r in rs) / (len(runs) * seconds[phase])
            lo, hi = starts[phase], starts[phase] + seconds[phase]
            limits = [v for r in rounds for t, v in r["limits"] if lo <= t < hi]
            span = f"{min(limits)}..{max(limits)}" if limits else "n/a"
            lines.append(f"| {way} | {phase} | {_iv(m['goodput'], 2)} | {_f(good, 2)} | "
                         f"{_iv(m['P99 TTFT'])} | {_iv(m['P99 TPOT'], 1)} | {answered} / {sent} | {span} |")
    lines += ["", f"Moves of the autoscaled way, by run (seconds from the start of the run; the high phase starts "
              f"at {starts['high'] if 'high' in starts else '-'} s):", ""]
    for r in (r for r in d["rounds"] if r["way"] == verdicts.AUTOSCALED):
        moves = "; ".join(f"{m['at_s']:.0f} s {m['old']} -> {m['new']} ({m['code']})" for m in r["moves"]) or "none"
        lines.append(f"- run {r['repetition']}: {moves}")
    lines += ["", f"**Targets**: in every phase the autoscaled way matches the better static way (goodput at least "
              f"{verdicts.MATCH['goodput']:g}x, P99s at most {verdicts.MATCH['P99 TTFT']:g}x); met only when the "
              f"whole interval of the ratio does.", "",
              "| target | bound | figure [95% interval] | runs | verdict |", "|---|---|---|---|---|",
              *(f.row() for f in verdicts.autoscale_findings(d, raw)),
              "", "![autoscale](images/bench-autoscale.png)", ""]
    return lines


def _iv(iv, digits: int = 0) -> str:
    return "n/a" if iv is None else f"{_f(iv.value, digits)} [{_f(iv.lo, digits)}, {_f(iv.hi, digits)}]"


SETUPS = ("poolserve", "single-fcfs", "single-priority", "stock-two-pools")


def _poolserve_inside(ps: dict) -> list[str]:
    """What poolserve's own reports say about its online pool under the flood."""
    w, lines = ps["online_with_offline"], []
    if w.get("online_limit"):
        lo, hi = w["online_limit"]
        moves = "; ".join(f"{m['pool']} {m['old']} -> {m['new']} ({m['code']})" for m in ps.get("autoscaler_moves", []))
        lines.append(f"Poolserve's online limit (max_active_seqs) during the flood: {lo}..{hi}; autoscaler moves in "
                     f"the set-up: {moves or 'none'}.")
    st = w.get("server_timing_ms") or {}
    if st:
        lines.append("Its online requests' time to the first token under the flood, by step (router's "
                     "`Server-Timing`, P50 / P99 ms): " + ", ".join(
                         f"{k} {_f(v['p50'])} / {_f(v['p99'])}" for k, v in st.items() if v.get("n")) + ".")
    return [*lines, ""] if lines else []


def _borrowing(ps: dict) -> list[str]:
    on, off = ps["offline_alone"], ps.get("offline_alone_no_borrowing")
    if not off or "engine_output_tok_s" not in on:
        return []
    lift = _div(on["engine_output_tok_s"], off["engine_output_tok_s"])
    windows = ""
    if "windows_engine_output_tok_s" in on:
        n = len(on["windows_engine_output_tok_s"])
        windows = (f" {2 * n} windows of equal length, lending off and on alternating, each row the mean of its "
                   f"{n} (engines' tok/s: off {', '.join(_f(x) for x in off['windows_engine_output_tok_s'])}; on "
                   f"{', '.join(_f(x) for x in on['windows_engine_output_tok_s'])})")
    return [f"Borrowing, poolserve with online idle (offline tok/s counted by the engines, both pools summed, "
            f"and from whole responses completed in the window;{windows}):", "",
            "| online pool's lending | engines' tok/s | completed responses' tok/s | offline requests borrowed |",
            "|---|---:|---:|---:|",
            f"| off (offline pool alone) | {_f(off['engine_output_tok_s'])} | {_f(off['output_tok_s'])} | "
            f"{off['borrowed']} |",
            f"| on | {_f(on['engine_output_tok_s'])} | {_f(on['output_tok_s'])} | {on['borrowed']} |", "",
            f"Lift from borrowing: {_f(lift, 2)}x.", ""]


def _div(a, b):
    return None if a is None or not b else a / b


def mixed_section(d: dict) -> list[str]:
    s, res, fl, r, t = d["setup"], d["results"], d["contention_floor"], d["ratios"], d["targets_met"]
    lines = [
        "## Mixed online and offline load (`bench/mixed.py`)", "",
        f"Online: {s['online']}. Offline: {s['offline']}. Phases (s): {s['phases_s']}; an online request with no "
        f"token after {s['online_timeout_s']} s, or {s.get('online_drain_s', '-')} s after its phase, is cut off and "
        f"counts with its wait as its TTFT (a lower bound). The contention floor is the "
        f"stock two pools with only {s['floor_streams']} offline streams. Single pools: "
        f"{s.get('single_pools', 'one engine each')}. CPU priority: {s.get('cpu_priority', 'not recorded')}. "
        f"Whole run {d['wall_s']} s. {_machine(d)}",
        "",
        "| set-up | online P50 / P99 TTFT alone (ms) | online P50 / P99 TTFT with offline (ms) | "
        "online P99 TPOT with offline (ms) | online goodput with offline (req/s) | online timeouts | "
        "offline tok/s with online | offline tok/s alone | offline borrowed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in SETUPS:
        v = res[name]
        a, w = v["online_alone"], v["online_with_offline"]
        lines.append(f"| {name} | {_f(a['ttft_p50_ms'])} / {_f(a['ttft_p99_ms'])} | {_f(w['ttft_p50_ms'])} / "
                     f"{_f(w['ttft_p99_ms'])} | {_f(w['tpot_p99_ms'], 1)} | {_f(w['goodput_req_s'], 2)} | "
                     f"{w['timeouts']} | {_f(v['offline_with_online']['output_tok_s'])} | "
                     f"{_f(v['offline_alone']['output_tok_s'])} | {v['offline_alone']['borrowed']} |")
    fw = fl["online_with_offline"]
    lines += [f"| contention floor | | {_f(fw['ttft_p50_ms'])} / {_f(fw['ttft_p99_ms'])} | "
              f"{_f(fw['tpot_p99_ms'], 1)} | {_f(fw['goodput_req_s'], 2)} | {fw['timeouts']} | "
              f"{_f(fl['offline_with_online']['output_tok_s'])} | | |", "",
              *_poolserve_inside(res["poolserve"]),
              *_borrowing(res["poolserve"]),
              "| ratio (poolserve / baseline) | value |", "|---|---:|"]
    lines += [f"| {k} | {_f(v, 3)} |" for k, v in r.items()]
    lines += ["", "| target | result |", "|---|---|"]
    lines += [f"| {k.replace('_', ' ')} | {_yes(v)} |" for k, v in t.items()]
    lines += ["", "![mixed](images/bench-mixed.png)", ""]
    return lines


def render() -> str:
    """docs/benchmarks.md's text from the results and bench/notes.md (the plots aside)."""
    out = ["# Benchmarks", "",
           "Generated by `python -m bench.report` from `bench/results/*.json` (`make bench` runs everything and "
           "then this). Every comparison is measured side by side in one run; figures from different runs are "
           "not comparable on this shared 2-core machine.", ""]
    o, a, m, c = _load("overhead"), _load("autoscale"), _load("mixed"), _load("ceiling")
    if c:
        out += ceiling_section(c, _machine(c), RESULTS / "raw" / c["run"])
    if m:
        out += mixed_section(m)
    if o:
        out += overhead_section(o)
    if a:
        out += autoscale_section(a)
    notes = REPO / "bench" / "notes.md"
    if notes.exists():
        out += [notes.read_text()]
    return "\n".join(out) + "\n"


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    o, a = _load("overhead"), _load("autoscale")
    if o:
        plot_overhead(o, IMAGES / "bench-overhead.png")
    if a:
        plot_autoscale(a, IMAGES / "bench-autoscale.png")
    DOC.write_text(render())
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
