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
from infra.stats import percentile

DOC = REPO / "docs" / "benchmarks.md"
IMAGES = REPO / "docs" / "images"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _f(x, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _machine(d: dict) -> str:
    m = d["machine"]
    return (f"Measured {m['when']} on {m['hardware']} ({m['cores']} cores), Python {m['python']}, "
            f"Ray {m['ray']}, vLLM {m['vllm']}.")


def plot_overhead(d: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    found = verdicts.overhead_findings(d, RESULTS / "raw" / d["run"])[:len(d["setup"]["prompts"])]
    ivs = [f.interval for f in found]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    xs = range(len(ivs))
    ax.bar(xs, [iv.value for iv in ivs], 0.5, yerr=[[iv.value - iv.lo for iv in ivs], [iv.hi - iv.value for iv in ivs]],
           capsize=4, label="router − direct, median of paired differences")
    ax.axhline(verdicts.OVERHEAD_MS, color="grey", linestyle="--", label=f"target: {verdicts.OVERHEAD_MS:g} ms")
    ax.set_xticks(list(xs), [f"{p:,} tokens" for p in d["setup"]["prompts"]])
    ax.set_xlabel("prompt")
    ax.set_ylabel("TTFT added (ms)")
    ax.set_title(f"Router overhead, one request at a time (bars: 95% intervals, {d['setup']['rounds']} rounds)")
    ax.legend(fontsize=8)
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
    s, raw = d["setup"], RESULTS / "raw" / d["run"]
    pairs, loops = verdicts.overhead_pairs(raw), verdicts.overhead_loops(d, raw)
    found = verdicts.overhead_findings(d, raw)  # one per prompt length, then the req/s ratio
    lines = [
        "## Router overhead (`bench/overhead.py`)", "",
        f"The baseline is {s['baseline']} on the same core; both engines with a {s['max_model_len']:,}-token context. "
        f"{_machine(d)}", "",
        f"**Latency**, one request at a time ({s['pair_output']} output tokens), the two paths alternating request by "
        f"request, {s['pairs']} pairs at each prompt length in each of {s['rounds']} rounds, the lengths in a shuffled "
        f"order each round (seed {d['seed']}). The figure is the median of the pairs' TTFT differences, with its 95% "
        f"bootstrap interval over rounds and pairs, from the raw pairs in `bench/results/raw/{d['run']}/`. The router "
        "path's steps are the P50s of its `Server-Timing` header (its own work, reaching the engine, the gate's queue, "
        "the engine's first output); the direct path has no such split.", "",
        "| prompt tokens | TTFT P50 router / direct (ms) | added: median of paired differences (ms) | "
        "router path's steps, P50 (ms) |", "|---:|---:|---:|---|",
    ]
    for p, finding in zip(s["prompts"], found):
        rows = [r for r in pairs if r["prompt"] == p]
        ttft = {k: percentile([r[f"{k}_ttft_ms"] for r in rows], 50) for k in ("router", "direct")}
        steps = {k: percentile([r["router_steps_ms"][k] for r in rows if k in r["router_steps_ms"]], 50)
                 for k in dict.fromkeys(k for r in rows for k in r["router_steps_ms"])}
        lines.append(f"| {p:,} | {_f(ttft['router'], 1)} / {_f(ttft['direct'], 1)} | "
                     f"{finding.interval} | "
                     f"{', '.join(f'{k} {_f(v, 1)}' for k, v in steps.items())} |")
    lines += ["", f"**Throughput**, a closed loop of {s['concurrency']} streams of {s['loop_lengths']} tokens, "
              f"{s['rounds']} rounds of {s['measure_s']} s on each path in the order {', '.join(d['loop_order'])}:", "",
              "| path | req/s, mean of rounds | TTFT P50 / P99 (ms) | E2E P50 (ms) |", "|---|---:|---:|---:|"]
    for path, runs in loops.items():
        done = [x for r in runs for x in r.measured() if x.ok]
        rps = sum(len(r.completed_in_window()) / r.measure_s for r in runs) / len(runs)
        ttft = [x.ttft * 1e3 for x in done if x.ttft is not None]
        lines.append(f"| {path} | {_f(rps, 2)} | {_f(percentile(ttft, 50))} / {_f(percentile(ttft, 99))} | "
                     f"{_f(percentile([x.e2e * 1e3 for x in done if x.e2e is not None], 50))} |")
    return lines + ["", "| target | bound | figure [95% interval] | runs | verdict |", "|---|---|---|---|---|",
                    *(f.row() for f in found),
                    "", "![overhead](images/bench-overhead.png)", ""]


def autoscale_section(d: dict) -> list[str]:
    s, raw = d["setup"], RESULTS / "raw" / d["run"]
    figures, requests = verdicts.autoscale_figures(d, raw), verdicts.autoscale_requests(d, raw)
    rates, seconds = {name: rate for name, rate, _ in s["phases"]}, {name: sec for name, _, sec in s["phases"]}
    lines = [
        "## Autoscaler (`bench/autoscale.py`)", "",
        f"Pool `{s['pool']}`, safe range {s['safe_range']}, SLO P99 TTFT {s['slo']['ttft_p99_ms']:.0f} ms / TPOT "
        f"{s['slo']['tpot_p99_ms']:.0f} ms; Poisson chat with trace lengths; one load step, phases (name, req/s, "
        f"seconds) {s['phases']}, each phase starting as the one before ends; autoscaler {s['autoscale']}. The "
        f"autoscaled way starts at the bottom of the range, where it has rested a latency window. {s['runs']} runs of "
        f"each way, interleaved in the order {', '.join(d['order'])} (seed {d['seed']}); the k-th run of every way has "
        f"the same arrival times and lengths, and every run its own prompts. A request "
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


def render() -> str:
    """docs/benchmarks.md's text from the results and bench/notes.md (the plots aside)."""
    out = ["# Benchmarks", "",
           "Generated by `python -m bench.report` from `bench/results/*.json` (`make bench` runs every benchmark and "
           "then this). Every comparison is measured side by side in one run; figures from different runs are "
           "not comparable on this shared 2-core machine.", ""]
    o, a, c = load("overhead"), load("autoscale"), load("ceiling")
    out += _provenance(load("make_bench"), {"ceiling": c, "autoscale": a, "overhead": o})
    if c:
        out += ceiling_section(c, _machine(c), RESULTS / "raw" / c["run"])
    if o:
        out += overhead_section(o)
    if a:
        out += autoscale_section(a)
    notes = REPO / "bench" / "notes.md"
    if notes.exists():
        out += [notes.read_text()]
    return "\n".join(out) + "\n"


def _provenance(ran: dict | None, results: dict[str, dict | None]) -> list[str]:
    """Whether the benchmarks' sections come from one `make bench` run, and how long it took."""
    runs = {k: d["run"] for k, d in results.items() if d}
    if not runs:
        return []
    if ran and all(ran.get(k) == v for k, v in runs.items()):
        return [f"The {', '.join(runs)} sections below come from one `make bench` run ({ran['wall_s']:,} s, "
                f"measured {ran['machine']['when']}): runs {', '.join(runs.values())}. The notes after them tell "
                "of other runs.", ""]
    return [f"The {', '.join(runs)} sections below come from separate runs ("
            + ", ".join(f"{k} {v}" for k, v in runs.items()) + "), not from one `make bench`.", ""]


def main() -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    o, a = load("overhead"), load("autoscale")
    if o:
        plot_overhead(o, IMAGES / "bench-overhead.png")
    if a:
        plot_autoscale(a, IMAGES / "bench-autoscale.png")
    DOC.write_text(render())
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
