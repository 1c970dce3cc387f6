"""`make bench`: the overhead, autoscaler and mixed benchmarks in one run (one Ray cluster, one
poolserve deployment shared by the first three measurements), then docs/benchmarks.md.

    python -m bench.run_all      # about 15 minutes on the 2-core box
"""

from __future__ import annotations

import time

from bench import autoscale, mixed, overhead, report
from bench.common import deploy, local_config, ray_cluster, write_result


def main() -> None:
    started = time.monotonic()
    with ray_cluster():
        stack = deploy(local_config())
        two_pools = mixed.setup_two_pools("/stock")  # beside poolserve: the overhead baseline only
        write_result("overhead", overhead.run(stack, overhead.direct_target(two_pools.online_url)))
        # From here on each set-up runs with only its own engines on the two cores (a run that
        # kept these deployed measured every set-up several times slower; see bench/notes.md).
        mixed._teardown("stock")
        write_result("autoscale", autoscale.run(stack))
        stack.wait(lambda: autoscale._idle(stack), 300)
        results = {"poolserve": mixed.run_setup("poolserve", mixed.Endpoints(
            **{**mixed.POOLSERVE.__dict__, "admin": stack}))}
        mixed._teardown("poolserve")
        results["stock-two-pools"], floor = mixed.run_two_pools(mixed.setup_two_pools())
        results.update(mixed.run_single_pools())
        write_result("mixed", mixed.report(results, floor, time.monotonic() - started))
    report.main()
    print(f"make bench took {time.monotonic() - started:.0f}s")


if __name__ == "__main__":
    main()
