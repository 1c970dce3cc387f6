"""`make bench`: the ceiling benchmark (the parity flood, the ceiling and concurrency 1, in its
own process and Ray), then the autoscaler and overhead benchmarks (one Ray), then
docs/benchmarks.md from their results. `make bench-quick`, for development, runs each autoscaler
way and the overhead rounds once, leaves the ceiling benchmark out (25 minutes alone), keeps its
results in bench/results/quick/ (not in the repository) and prints its verdicts (inconclusive:
one run shows nothing of the host's drift); the doc stays as it is.

    python -m bench.run_all [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from bench import autoscale, overhead, report, verdicts
from bench.common import REPO, RESULTS, deploy, local_config, ray_cluster, teardown, write_result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.run_all")
    p.add_argument("--quick", action="store_true", help="one run of each way and round, into bench/results/quick/")
    quick = p.parse_args(argv).quick
    results = RESULTS / "quick" if quick else RESULTS
    runs = 1 if quick else None
    overhead.check_model()  # before the other benchmarks, not after them
    started = time.monotonic()

    def step(what: str) -> None:
        print(f"[{time.monotonic() - started:5.0f}s] {what}", flush=True)

    if not quick:
        step("ceiling benchmark")
        subprocess.run([sys.executable, "-m", "bench.ceiling"], cwd=REPO, check=True)
    with ray_cluster():
        step("deploy poolserve")
        stack = deploy(local_config())
        step("autoscale benchmark")
        scaled = autoscale.run(stack, runs=runs or autoscale.RUNS, results=results)
        write_result("autoscale", scaled, results)
        stack.wait(stack.idle, 300)
        teardown("poolserve")
        step("overhead benchmark")
        try:
            over = overhead.run(*overhead.deployed(), rounds=runs or overhead.ROUNDS, results=results)
        finally:
            teardown("stock-online")
            teardown("poolserve")
        write_result("overhead", over, results)
    ran = {"wall_s": round(time.monotonic() - started), "autoscale": scaled["run"], "overhead": over["run"]}
    if not quick:
        ran["ceiling"] = report.load("ceiling")["run"]
    write_result("make_bench", ran, results)
    if quick:
        for f in (verdicts.autoscale_findings(scaled, results / "raw" / scaled["run"])
                  + verdicts.overhead_findings(over, results / "raw" / over["run"])):
            print(f.row())
    else:
        report.main()
    step("done")
    print(f"make bench{'-quick' if quick else ''} took {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
