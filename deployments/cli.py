"""The `poolserve` command line."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path



def load_or_report(path: str, router: dict | None = None):
    """The resolved config, warnings printed; None (problems printed) when it is invalid."""
    from deployments.config import ConfigError, load

    try:
        resolved = load(path, router)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return None
    for w in resolved.warnings:
        print(f"warning: {w}")
    return resolved


def _cmd_validate(args) -> int:
    from deployments.config import local_jobs_problem, local_ray_problems

    resolved = load_or_report(args.config)
    if resolved is None:
        return 1
    for name, rp in resolved.pools.items():
        r = rp.safe_range
        src = f"profile {rp.config.limits.profile}" if rp.profile else "manual range (uncalibrated)"
        kv = f", KV {rp.kv_capacity_tokens} tokens" if rp.kv_capacity_tokens else ""
        print(f"pool {name}: {rp.config.route_prefix}, safe range [{r.low}, {r.high}] from {src}, "
              f"start {rp.start_seqs}{kv}, dtype {rp.dtype}")
    if not resolved.config.ray.address and (problem := local_jobs_problem(resolved)):
        print(f"warning: `poolserve serve` refuses it ({problem})")  # `serve run` on a cluster may not
    for problem in local_ray_problems(resolved) if not resolved.config.ray.address else ():
        print(f"warning: `poolserve serve` refuses it ({problem})")
    print(f"{args.config}: OK")
    return 0


def _cmd_make_tiny_model(args) -> int:
    from pools.tiny_model import directory_digest, make_tiny_model

    out = make_tiny_model(args.dir)
    print(f"wrote {out} (sha256 {directory_digest(out)[:16]})")
    return 0


def _cmd_hash_key(args) -> int:
    from router.auth import sha256_hex

    print(sha256_hex(args.key))
    return 0


def _cmd_kv_budget(args) -> int:
    from pools.engine import cpu_native_bf16
    from pools.kv_budget import GIB, KVBudget, ModelShape, checkpoint_dtype, engine_dtype

    if args.config:
        from deployments.config import load

        resolved = load(args.config)
        pool = resolved.pools[args.pool or next(iter(resolved.pools))]
        model_dir, gib = Path(resolved.model_source), pool.config.engine.kv_cache_gb
        block = pool.config.engine.block_size or 16
        lengths = [pool.config.traffic.p50_tokens, pool.config.traffic.p90_tokens, pool.config.traffic.p99_tokens]
        dtype = pool.dtype
    else:
        model_dir, gib, block = Path(args.model_dir), args.kv_gb, args.block_size
        lengths = [int(x) for x in args.lengths.split(",")]
    hf = json.loads((model_dir / "config.json").read_text())
    if not args.config:  # as a CPU pool on this machine would ask for it
        dtype = engine_dtype(args.dtype, checkpoint_dtype(hf), cpu_native_bf16())
    shape = ModelShape.from_hf_config(hf, dtype)
    kv = KVBudget(shape, int(gib * GIB), block)
    print(f"model {model_dir}: {shape.layers} layers x {shape.kv_heads} KV heads x {shape.head_dim} head_dim x "
          f"{shape.bytes_per_element} bytes (dtype {dtype})")
    print(f"KV bytes per token: {shape.bytes_per_token}")
    print(f"KV budget {gib} GiB = {kv.capacity_tokens} tokens ({kv.capacity_blocks} blocks of {block})")
    for label, n in zip(("p50", "p90", "p99"), lengths):
        print(f"  {label} {n:>6} tokens/sequence -> {kv.max_sequences(n)} concurrent sequences")
    return 0


def _cmd_serve(args) -> int:
    import ray
    from ray import serve

    from deployments.app import APP_NAME, deploy, on_free_metrics_port, on_local_dashboard, start_local_ray
    from deployments.batch_cli import DEFAULT_ADDRESS
    from deployments.config import ConfigError, local_jobs_problem, local_ray_problems
    from infra.wire import http_url

    given = {"host": args.host, "port": args.port}  # checked as the config's; the batch jobs' URL takes the port
    resolved = load_or_report(args.config, {k: v for k, v in given.items() if v is not None})
    if resolved is None:
        return 1
    c = resolved.config
    host, port = c.router.host, c.router.port
    dashboard = None  # of the Ray started here
    if c.ray.address:
        try:
            ray.init(address=c.ray.address)
        except ConnectionError as e:
            print(f"could not join the Ray cluster at ray.address {c.ray.address!r}: {e}\nIf the cluster has "
                  "Ray's token authentication on (Ray's default), run with RAY_AUTH_MODE=token and its token in "
                  "~/.ray/auth_token or RAY_AUTH_TOKEN (`ray get-auth-token` on the head node prints it).",
                  file=sys.stderr)
            return 1
    elif problem := local_jobs_problem(resolved):
        print(f"{args.config}: {problem}", file=sys.stderr)
        return 1
    elif problems := local_ray_problems(resolved):
        print(ConfigError(args.config, problems), file=sys.stderr)
        return 1
    else:
        moved = on_free_metrics_port(resolved)
        if (metrics := moved.config.ray.metrics_export_port) != c.ray.metrics_export_port:
            print(f"warning: port {c.ray.metrics_export_port} (ray.metrics_export_port) is taken: Ray's metrics are "
                  f"on {metrics}")
        resolved, c = moved, moved.config
        dashboard = start_local_ray(c.ray, keep_free={port}, include_dashboard=c.ray.dashboard)
        resolved = on_local_dashboard(resolved, dashboard)
    serve.start(http_options={"host": host, "port": port})
    print("deploying poolserve (about a minute on a CPU box) ...", flush=True)
    deploy(resolved, APP_NAME)
    base = http_url(host, port)
    print(f"\npoolserve is up at {base}")
    for name, rp in resolved.pools.items():
        print(f"  pool {name:<14} {base}{rp.config.route_prefix}/v1/chat/completions  (and /completions)")
    for line in _profile_lines():
        print(line)
    print(f"  default pool      {base}/v1/chat/completions")
    print(f"  models / health   {base}/v1/models  {base}/healthz")
    print(f"  admin             {base}/admin/pools  (Authorization: Bearer <admin key>)")
    print(f"  metrics           http://127.0.0.1:{c.ray.metrics_export_port}/metrics")
    if c.ray.dashboard and not c.ray.address:
        print(f"  ray dashboard     {dashboard}  (job submission: poolserve batch submit"
              + ("" if dashboard == DEFAULT_ADDRESS else f" --address {dashboard}") + ")")
    print("Ctrl-C stops it.", flush=True)
    stop = {signal.SIGINT, signal.SIGTERM}  # blocked, so that either one (a terminal, kill, a pod) reaches sigwait
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    signal.sigwait(stop)
    print("shutting down ...", flush=True)
    serve.shutdown()
    ray.shutdown()
    return 0


def _profile_lines(wait_s: float = 30.0) -> list[str]:
    """Which safe range each pool runs in and where it comes from, once every pool has reported."""
    import time

    from ray import serve

    from deployments.app import APP_NAME, CONTROLLER

    controller = serve.get_deployment_handle(CONTROLLER, APP_NAME)
    deadline = time.monotonic() + wait_s
    while True:
        status = controller.status.remote().result()
        if all(s.calibration.state != "unknown" for s in status.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    out = []
    for name, s in status.items():
        cal = s.calibration
        what = {"calibrating": "calibrating in the background", "profile": "calibrated"}.get(cal.state, cal.state)
        out.append(f"  safe range {name:<9} {list(s.serving_range)}: {what}: {cal.source}" +
                   (f"; {cal.detail}" if cal.state != "profile" and cal.detail else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="poolserve", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("validate", help="check a config file and print every problem")
    p.add_argument("config")
    p.set_defaults(fn=_cmd_validate)

    p = sub.add_parser("make-tiny-model", help="write the seeded tiny Llama into DIR")
    p.add_argument("dir")
    p.set_defaults(fn=_cmd_make_tiny_model)

    p = sub.add_parser("hash-key", help="print the SHA-256 of an API key for the config")
    p.add_argument("key")
    p.set_defaults(fn=_cmd_hash_key)

    p = sub.add_parser("kv-budget", help="KV bytes per token and sequences that fit")
    p.add_argument("--config")
    p.add_argument("--pool")
    p.add_argument("--model-dir")
    p.add_argument("--kv-gb", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="auto", help="model.dtype, resolved as for a CPU pool on this machine")
    p.add_argument("--lengths", default="512,1024,2048", help="p50,p90,p99 tokens per sequence")
    p.set_defaults(fn=_cmd_kv_budget)

    p = sub.add_parser("serve", help="start Ray locally and deploy the app from CONFIG")
    p.add_argument("config")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.set_defaults(fn=_cmd_serve)

    from deployments import batch_cli, calibrate_cli, k8s

    for register in (calibrate_cli.register, batch_cli.register, k8s.register):
        register(sub)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
