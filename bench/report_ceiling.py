"""docs/benchmarks.md's section on `bench/ceiling.py`: each figure as the mean of its rounds with
their range, and each comparison as a ratio of means with the range of the round-by-round
ratios (every poolserve round against every baseline round)."""

from __future__ import annotations

from pathlib import Path
from statistics import mean

from bench import verdicts


def _f(x, digits: int = 0) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


def _spread(values: list[float], digits: int = 0) -> str:
    if not values:
        return "n/a"
    if len(values) == 1:
        return _f(values[0], digits)
    return f"{_f(mean(values), digits)} [{_f(min(values), digits)}–{_f(max(values), digits)}]"


def _ratio(ours: list[float], theirs: list[float]) -> str:
    if not ours or not theirs or not all(theirs):
        return "n/a"
    pairs = [a / b for a in ours for b in theirs]
    return f"{mean(ours) / mean(theirs):.2f}x [{min(pairs):.2f}–{max(pairs):.2f}]"


FLOOD_METRICS = (  # (label, getter, digits, better)
    ("online TTFT P99 (ms)", lambda r: r["online_ttft_ms"]["p99"], 0, "lower"),
    ("online TTFT P50 (ms)", lambda r: r["online_ttft_ms"]["p50"], 0, "lower"),
    ("online TPOT P99 (ms)", lambda r: r["online_tpot_ms"]["p99"], 1, "lower"),
    ("online errors", lambda r: r["online_errors"], 3, "lower"),
    ("offline tok/s", lambda r: r["offline_tok_s"], 0, "higher"),
)


def _cores(rounds: list[dict], top: int = 8) -> list[tuple[str, list[float]]]:
    roles: dict[str, list[float]] = {}
    for r in rounds:
        for role, seconds in r["cpu_s"].items():
            roles.setdefault(role, []).append(seconds / r["window_s"])
    ranked = sorted(roles.items(), key=lambda kv: -mean(kv[1]))
    return ranked[:top]


STOCK_ARMS = {"stock-two-pools": "stock two pools", "stock-two-pools-bound": "stock two pools, engine cores bound"}


def _flood(d: dict) -> list[str]:
    by = {s: [r for r in d["flood"] if r["setup"] == s] for s in ("poolserve", *STOCK_ARMS)}
    by = {s: rs for s, rs in by.items() if rs}
    stock = [s for s in STOCK_ARMS if s in by]
    if "poolserve" not in by or not stock:
        return []
    names = {"poolserve": "poolserve", **STOCK_ARMS}
    lines = [f"| metric | {' | '.join(names[s] for s in by)} | "
             f"{' | '.join(f'poolserve / {names[s]}' for s in stock)} |", "|---|" + "---:|" * (len(by) + len(stock))]
    for label, get, digits, _ in FLOOD_METRICS:
        figures = {s: [get(r) for r in rs] for s, rs in by.items()}
        ratios = [_ratio(figures["poolserve"], figures[s]) if label != "online errors" else "" for s in stock]
        lines.append(f"| {label} | {' | '.join(_spread(v, digits) for v in figures.values())} | {' | '.join(ratios)} |")
    cpu = ["", "Cores each role used during the flood (CPU seconds over the window, mean [range] of the "
           "rounds; the other set-up idles meanwhile and counts here too):", "",
           f"| role | {' | '.join(f'during the {names[s]} rounds' for s in by)} |", "|---|" + "---:|" * len(by)]
    cores = {s: dict(_cores(rs, 12)) for s, rs in by.items()}
    for role in sorted({k for c in cores.values() for k in c}, key=lambda k: -max(mean(c.get(k, [0])) for c in
                                                                                  cores.values())):
        cpu.append(f"| {role} | {' | '.join(_spread(c.get(role, []), 2) for c in cores.values())} |")
    return [f"**Parity flood**, {len(by['poolserve'])} rounds per set-up in the order {d.get('flood_order')} (seed "
            f"{d.get('seed')}); mean [range] of the rounds' figures, and the ratio of the means with the range "
            "of the round-by-round ratios:", "", *lines, *cpu, ""]


def _ceiling(d: dict) -> list[str]:
    paths: dict[str, list[dict]] = {}
    for r in d["ceiling"]:
        paths.setdefault(r["path"], []).append(r)
    if not paths:
        return []
    raws = [[r["output_tok_s"] for r in paths[k]] for k in ("raw-engine", "raw-engine" + verdicts.BOUND) if k in paths]
    raw = max(raws, key=mean, default=[])  # the stronger arm
    lines = ["| path | output tok/s | vs the raw engine (its stronger arm) | CPU s per 1,000 output tokens "
             "(all processes) | top roles (CPU s per 1,000 tokens) |", "|---|---:|---:|---:|---|"]
    for name, rounds in sorted(paths.items(), key=lambda kv: -mean(r["output_tok_s"] for r in kv[1])):
        tok = [r["output_tok_s"] for r in rounds]
        per = [r["cpu_s_per_1k_tokens"] for r in rounds if "cpu_s_per_1k_tokens" in r]
        total = [sum(p.values()) for p in per]
        roles: dict[str, list[float]] = {}
        for p in per:
            for role, v in p.items():
                roles.setdefault(role, []).append(v)
        top = ", ".join(f"{k} {mean(v):.2f}" for k, v in sorted(roles.items(), key=lambda kv: -mean(kv[1]))[:4])
        lines.append(f"| {name} | {_spread(tok)} | {_ratio(tok, raw) if raw else 'n/a'} | {_spread(total, 2)} | "
                     f"{top} |")
    c1: dict[str, list[dict]] = {}
    for r in d.get("c1", []):
        c1.setdefault(r["path"], []).append(r)
    if c1:
        lines += ["", "At concurrency 1 (online lengths, one engine idle otherwise):", "",
                  "| path | TTFT P50 (ms) | TTFT P99 (ms) | TPOT P50 (ms) |", "|---|---:|---:|---:|"]
        for name, rounds in c1.items():
            lines.append(f"| {name} | {_spread([r['ttft_p50_ms'] for r in rounds], 1)} | "
                         f"{_spread([r['ttft_p99_ms'] for r in rounds], 1)} | "
                         f"{_spread([r['tpot_p50_ms'] for r in rounds], 1)} |")
    seeds = ("; the k-th round on every engine on the prompts of seed k, so that no engine finds a round's prompts "
             "in its prefix cache" if all("prompt_seed" in r for r in d.get("ceiling", [])) else "")
    bound = ("; a path ending in `-bound` is that baseline with its engine core bound beside its workers, "
             "as poolserve binds its pools'" if any(p.endswith(verdicts.BOUND) for p in [*paths, *c1]) else "")
    return ["**Ceiling**, one engine on core 1 with 64 sequences, each path in shuffled rounds "
            f"({d.get('ceiling_order')}){seeds}{bound}:", "", *lines, ""]


def _serving(d: dict, raw: Path) -> list[str]:
    """poolserve's serving processes at the ceiling, CPU s per 1,000 output tokens by process:
    this run against the reference run before the pools answered their own HTTP."""
    before = [verdicts.serving_cpu(r["cpu_s_per_1k_tokens"]) for r in verdicts.before_rounds(raw)]
    now = [verdicts.serving_cpu(r["cpu_s_per_1k_tokens"]) for r in d["ceiling"]
           if r["path"] == "poolserve" and "cpu_s_per_1k_tokens" in r]
    if not before or not now:
        return []
    roles = sorted({k for p in before + now for k in p}, key=lambda k: -max(
        mean(p.get(k, 0.0) for p in before), mean(p.get(k, 0.0) for p in now)))
    lines = [f"poolserve's serving processes at the ceiling, CPU seconds per 1,000 output tokens (mean [range] of "
             f"the rounds), before the pools answered their own HTTP (run {verdicts.BEFORE}) and now:", "",
             "| process | before | now |", "|---|---:|---:|"]
    for role in roles:
        lines.append(f"| {role} | {_spread([p.get(role, 0.0) for p in before], 3)} | "
                     f"{_spread([p.get(role, 0.0) for p in now], 3)} |")
    lines.append(f"| all of them | {_spread([sum(p.values()) for p in before], 3)} | "
                 f"{_spread([sum(p.values()) for p in now], 3)} |")
    return [*lines, ""]


def _targets(d: dict, raw: Path) -> list[str]:
    found = verdicts.findings(d, raw)
    if not found:
        return []
    return ["**Targets**, each judged from the raw data (`python -m bench.verdicts`): the figure with its 95% "
            "bootstrap interval over runs and the requests in them; met only when the whole interval meets the "
            f"bound, missed when none of it does, and inconclusive with fewer than {verdicts.MIN_RUNS} runs a side. "
            "Where a baseline ran in two arms (its engine core free and bound), each target is judged against the arm "
            "that did better on that target's own figure, named beside the verdict: the one poolserve must beat, "
            "though no single deployment of the baseline need reach both arms' best figures at once.",
            "", "| target | bound | figure [95% interval] | runs | verdict |", "|---|---:|---:|---:|---|",
            *(f.row() for f in found), ""]


def ceiling_section(d: dict, machine: str, raw: Path | None = None) -> list[str]:
    """The section; with `raw` (the run's raw data), its targets' verdicts too."""
    what = ("poolserve against a stock two-pool `ray.serve.llm` deployment given the same cores, engine limits "
            "and nice, under a batch flood, and every serving path against the bare engine at the ceiling."
            if d["flood"] else
            "Every serving path against the bare engine at the ceiling (this run had no flood rounds).")
    return ["## Where the time and the CPU go (`bench/ceiling.py`)", "",
            f"{what} Raw per-request data: `bench/results/raw/{d['run']}/`. Whole run {d['wall_s']:.0f} s. {machine}",
            "", *(_targets(d, raw) if raw else []), *_flood(d), *_ceiling(d), *(_serving(d, raw) if raw else [])]
