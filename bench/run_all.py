"""`make bench`: the autoscaler, mixed and overhead benchmarks in one run (one Ray cluster, one
poolserve deployment, three engine starts for the baselines), then docs/benchmarks.md.

    python -m bench.run_all      # the autoscaler's 3 runs a way alone took 14 minutes on the 2-core box
"""

from __future__ import annotations

import time

from bench import autoscale, mixed, overhead, report
from bench.common import deploy, local_config, ray_cluster, teardown, write_result


def main() -> None:
    started = time.monotonic()

    def step(what: str) -> None:
        print(f"[{time.monotonic() - started:5.0f}s] {what}", flush=True)

    with ray_cluster():
        step("deploy poolserve")
        stack = deploy(local_config())
        step("autoscale benchmark")
        write_result("autoscale", autoscale.run(stack))
        stack.wait(stack.idle, 300)
        step("mixed: poolserve")
        results = {"poolserve": mixed.run_setup("poolserve", mixed.Endpoints(
            **{**mixed.POOLSERVE.__dict__, "admin": stack}))}
        stack.wait(stack.idle, 300)
        # The stock two pools, deployed beside poolserve: the overhead baseline, then (once
        # poolserve is gone, so that each set-up runs with only its own engines on the two
        # cores) the stock set-up of the mixed benchmark.
        step("deploy the stock two pools")
        two_pools = mixed.setup_two_pools("/stock")
        step("overhead benchmark")
        write_result("overhead", overhead.run(stack, overhead.direct_target(two_pools.online_url)))
        teardown("poolserve")
        step("mixed: stock two pools and the floor")
        results["stock-two-pools"], floor = mixed.run_two_pools(two_pools)
        step("mixed: single pools")
        results.update(mixed.run_single_pools())
        write_result("mixed", mixed.report(results, floor, time.monotonic() - started))
    report.main()
    step("done")
    print(f"make bench took {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
