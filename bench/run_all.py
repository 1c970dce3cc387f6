"""`make bench`: the autoscaler, mixed and overhead benchmarks in one run (one Ray cluster), then
docs/benchmarks.md from their results. `make bench-quick`, for development, runs each autoscaler
way and the overhead rounds once, leaves the mixed benchmark out (ten minutes alone), keeps its
results in bench/results/quick/ (not in the repository) and prints its verdicts (inconclusive:
one run shows nothing of the host's drift); the doc stays as it is.

    python -m bench.run_all [--quick]
"""

from __future__ import annotations

import argparse
import time

from bench import autoscale, mixed, overhead, report, verdicts
from bench.common import RESULTS, deploy, local_config, ray_cluster, teardown, write_result


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

    with ray_cluster():
        step("deploy poolserve")
        stack = deploy(local_config())
        step("autoscale benchmark")
        scaled = autoscale.run(stack, runs=runs or autoscale.RUNS, results=results)
        write_result("autoscale", scaled, results)
        stack.wait(stack.idle, 300)
        if quick:
            teardown("poolserve")
        else:
            _mixed(stack, step, started)  # tears poolserve down before the stock set-ups
        step("overhead benchmark")
        try:
            over = overhead.run(*overhead.deployed(), rounds=runs or overhead.ROUNDS, results=results)
        finally:
            teardown("stock-online")
            teardown("poolserve")
        write_result("overhead", over, results)
    if quick:
        for f in (verdicts.autoscale_findings(scaled, results / "raw" / scaled["run"])
                  + verdicts.overhead_findings(over, results / "raw" / over["run"])):
            print(f.row())
    else:
        report.main()
    step("done")
    print(f"make bench{'-quick' if quick else ''} took {time.monotonic() - started:.0f}s")


def _mixed(stack, step, started: float) -> None:
    step("mixed: poolserve")
    endpoints = mixed.Endpoints(**{**mixed.POOLSERVE.__dict__, "admin": stack})
    setups = {"poolserve": mixed.run_setup("poolserve", endpoints)}
    teardown("poolserve")  # each set-up runs with only its own engines on the two cores
    step("mixed: stock two pools and the floor")
    setups["stock-two-pools"], floor = mixed.run_two_pools(mixed.setup_two_pools("/stock"))
    step("mixed: single pools")
    setups.update(mixed.run_single_pools())
    write_result("mixed", mixed.report(setups, floor, time.monotonic() - started))


if __name__ == "__main__":
    main()
