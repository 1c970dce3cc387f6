"""The targets `bench/ceiling.py`, `bench/autoscale.py` and `bench/overhead.py` measure, each
judged from a run's raw data with a 95% bootstrap interval: met when the whole interval meets it,
missed when none of it does, inconclusive otherwise (and whenever a side has fewer than MIN_RUNS
runs, since one run shows nothing of the host's drift between runs).

    python -m bench.verdicts bench/results/raw/<run>
"""

from __future__ import annotations

import gzip
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from bench import intervals
from bench.intervals import Interval, Verdict
from infra.loadgen import read_raw
from infra.results import ttfts_with_timeouts

MIN_RUNS = 2
OURS, STOCK = "poolserve", "stock-two-pools"
BOUND = "-bound"  # a baseline's name with its engine core bound beside its workers (bench.setups.arm)
# The ceiling rounds of the code before the pools answered their own HTTP (commit 78ede34: router
# in front, Serve's Python proxy), `--rounds 0 --ceiling-rounds 2`: what "today's" serving CPU
# was. Only its record is kept; bench/notes.md says when and where it ran.
BEFORE = "20261202-before"


@dataclass(frozen=True)
class Target:
    name: str
    bound: float
    better: Literal["lower", "higher"]


@dataclass(frozen=True)
class Finding:
    target: Target
    verdict: Verdict
    interval: Interval | None = None
    runs: tuple[int, ...] = ()  # runs on each side
    why: str = ""

    def row(self) -> str:
        """The finding as a row of docs/benchmarks.md's target table."""
        sign = "≤" if self.target.better == "lower" else "≥"
        figure = str(self.interval) if self.interval else self.why
        runs = " / ".join(map(str, self.runs)) or "-"
        note = f" ({self.why})" if self.why and self.interval else ""
        return f"| {self.target.name} | {sign} {self.target.bound:g} | {figure} | {runs} | **{self.verdict}**{note} |"


def busy(samples: list[dict], pool: str) -> dict:
    """From the pool samples of one round: while requests waited at the pool's gate, the share
    of samples in which its engine ran anything, and its mean occupancy (sequences running over
    the limit)."""
    queued = [r for s in samples for r in s.get(pool, []) if r["queued"] > 0]
    if not queued:
        return {"samples": 0}
    return {"samples": len(queued), "busy": sum(r["running"] > 0 for r in queued) / len(queued),
            "occupancy": sum(min(1.0, r["running"] / r["limit"]) for r in queued) / len(queued)}


def _read(path: Path):
    gz = path.with_name(path.name + ".gz")
    if gz.exists():
        return json.loads(gzip.decompress(gz.read_bytes()))
    return json.loads(path.read_text())


def stronger(arms: dict[str, list[list[float]]], stat, better: str) -> tuple[str, list[list[float]]]:
    """Of a baseline's arms (free, bound), each with data, the one poolserve must beat: the best
    `stat` over all its requests. ("", []) if there is none."""
    if not arms:
        return "", []
    pick = (min if better == "lower" else max)(arms, key=lambda k: stat([x for r in arms[k] for x in r]))
    return pick, arms[pick]


def _arms(by: dict, baseline: str) -> dict:
    """A baseline's two arms (free, bound) from figures by set-up or path, either maybe empty."""
    return {k: by.get(k, []) for k in (baseline, baseline + BOUND)}


def _judge(target: Target, ours: list[list[float]], theirs: list[list[float]] | dict | None, stat) -> Finding:
    """`theirs` as a dict of a baseline's arms: judged against the stronger, named where both ran."""
    arm = ""
    if isinstance(theirs, dict):
        have = {k: v for k, v in theirs.items() if v and all(v)}
        name, theirs = stronger(have, stat, target.better)
        placement = "bound" if name.endswith(BOUND) else "free"
        arm = f"the baseline's stronger arm: engine core {placement}" if len(have) > 1 else ""
    runs = (len(ours),) if theirs is None else (len(ours), len(theirs))
    sides = [ours] if theirs is None else [ours, theirs]
    if any(not side or not all(side) for side in sides):
        return Finding(target, "inconclusive", runs=runs, why="no data")
    iv = intervals.interval(ours, stat) if theirs is None else intervals.ratio(ours, theirs, stat)
    if min(runs) < MIN_RUNS:
        return Finding(target, "inconclusive", iv, runs, "; ".join(filter(None, [f"fewer than {MIN_RUNS} runs a side",
                                                                                arm])))
    return Finding(target, intervals.verdict(iv, target.bound, target.better), iv, runs, arm)


def _flood(d: dict, raw: Path) -> list[Finding]:
    rounds = {s: [r for r in d["flood"] if r["setup"] == s] for s in (OURS, STOCK, STOCK + BOUND)}
    rounds = {s: rs for s, rs in rounds.items() if rs or s != STOCK + BOUND}  # a run with one arm, as before
    timeout = d.get("online_timeout_s")
    online = {s: [read_raw(raw / f"flood-{r['round']:02d}-{s}-online.jsonl.gz") for r in rs]
              for s, rs in rounds.items()}
    ttft = {s: [ttfts_with_timeouts(rs, timeout) for rs in runs] for s, runs in online.items()}
    tpot = {s: [[r.tpot for r in rs if r.tpot is not None] for rs in runs] for s, runs in online.items()}
    tok = {s: [[r["offline_tok_s"]] for r in rs] for s, rs in rounds.items()}
    out = [
        _judge(Target("flood: online P99 TTFT, poolserve / stock two pools", 1.0, "lower"),
               ttft[OURS], _arms(ttft, STOCK), intervals.p99),
        _judge(Target("flood: online P99 TPOT, poolserve / stock two pools", 1.0, "lower"),
               tpot[OURS], _arms(tpot, STOCK), intervals.p99),
        _judge(Target("flood: offline tok/s, poolserve / stock two pools", 0.95, "higher"),
               tok[OURS], _arms(tok, STOCK), intervals.mean),
    ]
    sent = [r["online_sent_in_window"] / r["online_scheduled"] for rs in rounds.values() for r in rs
            if r["online_scheduled"]]
    schedule = Target("flood: share of the online schedule sent in its window, worst round of any set-up", 1.0,
                      "higher")
    out.append(Finding(schedule, "met" if sent and min(sent) >= 1.0 else "missed",
                       runs=tuple(len(rs) for rs in rounds.values()),
                       why=f"{min(sent):.3f}" if sent else "no data"))
    for pool in ("offline-batch", "online-chat"):
        shares = [[b["busy"]] for b in (busy(_read(raw / f"flood-{r['round']:02d}-{OURS}-pools.json"), pool)
                                        for r in rounds[OURS]) if b["samples"]]
        out.append(_judge(Target(f"flood: {pool} engine busy while requests wait at its gate", 0.9, "higher"),
                          shares, None, intervals.mean))
    return out


def _ceiling(d: dict, raw: Path) -> list[Finding]:
    tok: dict[str, list[list[float]]] = {}
    for r in d["ceiling"]:
        tok.setdefault(r["path"], []).append([r["output_tok_s"]])
    c1: dict[str, list[list[float]]] = {}
    for r in d.get("c1", []):
        c1.setdefault(r["path"], []).append(_read(raw / f"c1-{r['round']:02d}-{r['path']}.json")["ttfts"])
    pairs = [("ceiling: output tok/s, poolserve offline pool / vLLM's server", "poolserve", "vllm-server", 0.6),
             ("ceiling: output tok/s, poolserve offline pool / stock one pool", "poolserve", "stock-one-pool", 1.5),
             ("ceiling: output tok/s, batch job / raw engine", "batch-job", "raw-engine", 0.5)]
    out = [_judge(Target(name, bound, "higher"), tok.get(a, []), _arms(tok, b), intervals.mean)
           for name, a, b, bound in pairs]
    out.append(_judge(Target("concurrency 1: TTFT P50, poolserve / vLLM's server", 1.2, "lower"),
                      c1.get("poolserve", []), _arms(c1, "vllm-server"), intervals.p50))
    cpu = [[sum(serving_cpu(r["cpu_s_per_1k_tokens"]).values())] for r in d["ceiling"]
           if r["path"] == OURS and "cpu_s_per_1k_tokens" in r]
    out.append(_judge(Target(f"ceiling: CPU s per 1,000 output tokens of the serving processes, poolserve / "
                             f"poolserve before (run {BEFORE})", 0.5, "lower"), cpu, _before_cpu(raw), intervals.mean))
    return out


def serving_cpu(cpu_s_per_1k: dict[str, float]) -> dict[str, float]:
    """The serving processes of poolserve at the ceiling: everything on its request path and
    behind it but the engines (Serve's HTTP entry, poolserve's replicas, the Serve controller,
    Ray's daemons); not the client, nor the idle replicas of the other set-ups."""
    keep = ("HTTP proxy", "Serve controller", "Ray daemons", "replica poolserve")
    return {k: v for k, v in cpu_s_per_1k.items() if k.startswith(keep)}


def before_rounds(raw: Path) -> list[dict]:
    """poolserve's ceiling rounds of the reference run before this change (none if it is not
    beside `raw`)."""
    path = raw.parent / BEFORE / "partial.json"
    if not path.exists():
        return []
    return [r for r in json.loads(path.read_text())["ceiling"] if r["path"] == OURS]


def _before_cpu(raw: Path) -> list[list[float]]:
    return [[sum(serving_cpu(r["cpu_s_per_1k_tokens"]).values())] for r in before_rounds(raw)]


# -- the autoscaler's load step -------------------------------------------------------------------

AUTOSCALED, STATIC = "autoscaled", ("static-low", "static-high")
# "Matches the best static way": within these factors of it, at the interval's far end (a P99
# over one phase's few dozen requests moves by a fifth from one run to the next on this box).
MATCH = {"goodput": 0.9, "P99 TTFT": 1.25, "P99 TPOT": 1.25}


def within_slo(r, slo: dict) -> float:
    """1 for a request answered within the pool's SLO (TTFT, and TPOT where it has one)."""
    return float(r.ok and r.ttft is not None and r.ttft * 1e3 <= slo["ttft_p99_ms"]
                 and (r.tpot is None or r.tpot * 1e3 <= slo["tpot_p99_ms"]))


def autoscale_requests(d: dict, raw: Path) -> dict[str, dict[str, list[list]]]:
    """way -> phase -> one list of the load generator's results per run."""
    out: dict = {}
    for r in d["rounds"]:
        for phase, _, _ in d["setup"]["phases"]:
            out.setdefault(r["way"], {}).setdefault(phase, []).append(
                read_raw(raw / f"{r['round']:02d}-{r['way']}-{phase}.jsonl.gz"))
    return out


def autoscale_samples(d: dict, raw: Path) -> dict[str, dict[str, dict[str, list[list[float]]]]]:
    """way -> phase -> metric -> one list per run: within-SLO indicators ("goodput"), TTFTs with
    timeouts at their wait ("P99 TTFT", ms) and TPOTs ("P99 TPOT", ms)."""
    s = d["setup"]
    return {way: {phase: {"goodput": [[within_slo(x, s["slo"]) for x in rs] for rs in runs],
                          "P99 TTFT": [[t * 1e3 for t in ttfts_with_timeouts(rs, s["timeout_s"])] for rs in runs],
                          "P99 TPOT": [[x.tpot * 1e3 for x in rs if x.tpot is not None] for rs in runs]}
                  for phase, runs in phases.items()}
            for way, phases in autoscale_requests(d, raw).items()}


STATS = {"goodput": intervals.mean, "P99 TTFT": intervals.p99, "P99 TPOT": intervals.p99}


def autoscale_figures(d: dict, raw: Path) -> dict[str, dict[str, dict[str, Interval | None]]]:
    """way -> phase -> metric -> the figure over every run with its interval (None without data)."""
    return {way: {phase: {m: intervals.interval(runs, STATS[m]) if runs and all(runs) else None
                          for m, runs in metrics.items()} for phase, metrics in phases.items()}
            for way, phases in autoscale_samples(d, raw).items()}


def _best_static(samples: dict, phase: str) -> str | None:
    """The static way a user would have picked for this phase: the most requests within the SLO,
    then the lower P99 TTFT. One way per phase, not the best figure of each metric from either
    (static-low's batch of one has the lowest TPOT and the longest queue: no set-up is both)."""
    def key(w: str):
        m = samples[w][phase]
        pooled = {k: [x for run in m[k] for x in run] for k in ("goodput", "P99 TTFT")}
        return (-intervals.mean(pooled["goodput"]), intervals.p99(pooled["P99 TTFT"]))
    ways = [w for w in STATIC if w in samples and all(samples[w][phase]["goodput"])
            and all(samples[w][phase]["P99 TTFT"])]
    return min(ways, key=key) if ways else None


def autoscale_findings(d: dict, raw: Path) -> list[Finding]:
    """Per phase and metric: the autoscaled way against the better static way in that phase."""
    samples, out = autoscale_samples(d, raw), []
    if AUTOSCALED not in samples:
        return out
    for phase, _, _ in d["setup"]["phases"]:
        if (best := _best_static(samples, phase)) is None:
            continue
        for metric, bound in MATCH.items():
            target = Target(f"autoscaler, {phase}: {metric}, autoscaled / better static way ({best})", bound,
                            "higher" if metric == "goodput" else "lower")
            out.append(_judge(target, samples[AUTOSCALED][phase][metric], samples[best][phase][metric],
                              STATS[metric]))
    return out


# -- router overhead ------------------------------------------------------------------------------

OVERHEAD_MS = 5.0  # TTFT the router path may add at its median


def overhead_pairs(raw: Path) -> list[dict]:
    with gzip.open(raw / "pairs.jsonl.gz", "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def overhead_differences(d: dict, raw: Path) -> dict[int, list[list[float]]]:
    """prompt tokens -> one list per round of the pairs' TTFT differences (router − direct, ms)."""
    out: dict[int, list[list[float]]] = {}
    pairs = overhead_pairs(raw)
    for p in d["setup"]["prompts"]:
        rows = [r for r in pairs if r["prompt"] == p]
        out[p] = [[r["router_ttft_ms"] - r["direct_ttft_ms"] for r in rows if r["round"] == k]
                  for k in sorted({r["round"] for r in rows})]
    return out


def overhead_loops(d: dict, raw: Path) -> dict[str, list]:
    """path -> one `Run` per closed-loop round, rebuilt from its raw requests and window."""
    from infra.results import Run

    out: dict[str, list] = {}
    for i, path in enumerate(d["loop_order"]):
        stem = raw / f"loop-{i:02d}-{path}"
        window = json.loads(Path(f"{stem}.json").read_text())["window"]
        out.setdefault(path, []).append(Run(read_raw(f"{stem}.jsonl.gz"), window["from"], window["seconds"], {},
                                            "closed", d["setup"]["concurrency"]))
    return out


def overhead_findings(d: dict, raw: Path) -> list[Finding]:
    """TTFT the router adds at each prompt length (the median of paired differences), and the
    closed loop's req/s through the router over direct."""
    out = [_judge(Target(f"router overhead, {p:,}-token prompts: TTFT added, median of paired differences (ms)",
                         OVERHEAD_MS, "lower"), diffs, None, intervals.p50)
           for p, diffs in overhead_differences(d, raw).items()]
    rps = {path: [[len(r.completed_in_window()) / r.measure_s] for r in runs]
           for path, runs in overhead_loops(d, raw).items()}
    out.append(_judge(Target(f"router overhead, {d['setup']['concurrency']} streams: req/s, router / direct", 0.9,
                             "higher"), rps.get("router", []), rps.get("direct", []), intervals.mean))
    return out


def findings(d: dict, raw: Path) -> list[Finding]:
    """Every target `d` (a run's record, as bench/ceiling.py writes it) has data for."""
    return (_flood(d, raw) if d["flood"] else []) + (_ceiling(d, raw) if d["ceiling"] or d.get("c1") else [])


def main(argv: list[str] | None = None) -> None:
    raw = Path((argv or sys.argv[1:])[0])
    if (raw / "record.json").exists():  # an autoscaler or overhead run
        d = json.loads((raw / "record.json").read_text())
        judged = overhead_findings(d, raw) if d["run"].endswith("-overhead") else autoscale_findings(d, raw)
    else:
        judged = findings(json.loads((raw / "partial.json").read_text()), raw)
    for f in judged:
        print(f.row())


if __name__ == "__main__":
    main()
