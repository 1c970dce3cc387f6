"""The composition root: one config in, Serve applications out.

    poolserve (at /)                  router (ingress) -> autoscale-controller, quota-ledger,
                                      batch-service
    poolserve-<pool> (at its prefix)  pool-<pool>: PoolIngress, the pool's replicas answering
                                      their own HTTP (route, gate and engine in one process)

The pools reach the controller and the ledger, and the router and each other reach the pools,
by name across applications (`infra.handles.Lookup`). `deploy(resolved)` runs them all
(`poolserve serve`, the tests, the benchmarks); `app_builder(args)` is the import path for
`serve run` / `serve deploy` / KubeRay's serveConfigV2 (`deployments.app:app_builder` with
args `{config_path}` or `{config, base_dir}`, plus `part`: `control` or a pool's name, and
`name`, the control application's). Serve wiring lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import errno
import inspect
import os
import socket
from collections.abc import Collection
from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import RunTarget
from ray.serve.deployment import Application

from autoscale.ranges import PoolSpec
from autoscale.service import ControllerService
from deployments.config import RAY_AGENT_PORT, Resolved, ResolvedPool, load, parse, resolve
from infra.handles import Lookup
from infra.state import DirStore, GcsStore
from pools.gate import Ceilings, QueuePolicy
from pools.kv_budget import GIB
from pools.types import PriorityClass
from router.leases import LedgerService
from router.policy import BorrowRule
from router.quota import Quota

APP_NAME = "poolserve"  # the control application's; each pool's is `<APP_NAME>-<pool>`
ROUTER = "router"
CONTROLLER = "autoscale-controller"
LEDGER = "quota-ledger"
BATCHES = "batch-service"
DASHBOARD_HOST, DASHBOARD_PORT = "127.0.0.1", 8265  # Ray's defaults for a dashboard it starts
STATE_NAMESPACE = "poolserve"  # Ray's GCS key-value namespace of the control state that outlives replicas


def pool_deployment_name(pool: str) -> str:
    return f"pool-{pool}"


def pool_app_name(pool: str, app: str = APP_NAME) -> str:
    return f"{app}-{pool}"


def replica_class(deployment: str, app: str = APP_NAME) -> str:
    """Ray's class name of a deployment's replica actors, and their processes' title."""
    pool = deployment.removeprefix("pool-")
    return f"ServeReplica:{pool_app_name(pool, app) if pool != deployment else app}:{deployment}"


def fingerprint_base(resolved: Resolved, rp: ResolvedPool) -> dict[str, Any]:
    m, pool = resolved.config.model, rp.config
    return {"model": m.id, "dtype": rp.dtype, "quantization": m.quantization or "none",
            "max_model_len": m.max_model_len, "max_num_seqs": pool.engine.max_num_seqs,
            "max_num_batched_tokens": pool.engine.max_num_batched_tokens, "kv_cache_gb": pool.engine.kv_cache_gb}


def engine_env() -> dict[str, str]:
    """Environment for every engine process. vLLM 0.29 with torch 2.10 saves an AOT-compiled
    model but fails to load it back ("'function' object has no attribute 'finalize_loading'")
    and compiles again at every start; its older compile cache loads, and an engine starts
    faster without AOT (bench/notes.md). The deploying process's own `VLLM_USE_AOT_COMPILE`
    wins."""
    return {"VLLM_USE_AOT_COMPILE": os.environ.get("VLLM_USE_AOT_COMPILE", "0")}


def start_local_ray(ray_config, keep_free: Collection[int] = (), **init: Any) -> str | None:
    """Start the Ray that poolserve runs on itself (`poolserve serve`, the integration suite,
    the benchmarks): its processes inherit this process's environment, which carries Serve's
    ingress choice (`ray.haproxy`). An ingress replica's drain before it stops is HAProxy's
    grace to take it out of rotation: on one host that takes milliseconds, not Serve's 30 s.
    Returns its dashboard's URL (None: no dashboard), which is its job API; `keep_free` are ports
    the dashboard must not take though they are free now (the router's, bound by Serve next)."""
    import ray

    if ray_config.haproxy:
        os.environ.update(RAY_SERVE_ENABLE_HA_PROXY="1", RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S="2")
    else:
        os.environ.pop("RAY_SERVE_ENABLE_HA_PROXY", None)
    if init.get("include_dashboard"):
        # Ray itself would move to a free port where 8265 is taken and report the move only as a
        # URL for people (RAY_OVERRIDE_DASHBOARD_URL replaces it): pick the port here instead.
        init.setdefault("dashboard_host", DASHBOARD_HOST)
        init.setdefault("dashboard_port", free_port(init["dashboard_host"], DASHBOARD_PORT,
                                                    skip={ray_config.metrics_export_port, *keep_free}))
    ray.init(**init, **local_ray_init_kwargs(ray_config))
    return f"http://{init['dashboard_host']}:{init['dashboard_port']}" if init.get("include_dashboard") else None


def free_port(host: str, first: int, tries: int = 50, skip: Collection[int] = (), what: str = "Ray's dashboard"
              ) -> int:
    """The first port from `first` that `what` can bind on `host`, tested as Ray tests it, and
    not one of `skip` (ports this Ray is given for something else)."""
    for port in (p for p in range(first, first + tries) if p not in skip):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    continue
                raise  # not a taken port: the host itself (an address it does not have, say)
            return port
    raise RuntimeError(f"no free port for {what} in {first}-{first + tries - 1}")


def on_free_metrics_port(resolved: Resolved) -> Resolved:
    """For a Ray poolserve starts itself: `ray.metrics_export_port`, or the first free port after
    it. Taken (8080 often is), Ray's agent failed to bind it and Ray's start timed out after 30 s
    saying only that the node did not come up."""
    ray_config = resolved.config.ray
    port = free_port("", ray_config.metrics_export_port, what="Ray's metrics (ray.metrics_export_port)",
                     skip={resolved.config.router.port, RAY_AGENT_PORT})  # free now, but Serve and Ray bind them next
    if port == ray_config.metrics_export_port:
        return resolved
    ray_config = ray_config.model_copy(update={"metrics_export_port": port})
    return dataclasses.replace(resolved, config=resolved.config.model_copy(update={"ray": ray_config}))


def on_local_dashboard(resolved: Resolved, url: str | None) -> Resolved:
    """Batches go to the job API of the Ray poolserve started, unless the config names one:
    where 8265 is taken (by another Ray on the machine, say), the default address would submit
    every batch, the tenant's key with it, there."""
    batches = resolved.config.batches
    if url is None or batches.names_job_api:
        return resolved
    config = resolved.config.model_copy(update={"batches": batches.model_copy(update={"dashboard_url": url})})
    return dataclasses.replace(resolved, config=config)


def local_ray_init_kwargs(ray_config) -> dict[str, Any]:
    """`ray.init` arguments for a Ray that poolserve starts itself (`poolserve serve`, the
    integration suite, the benchmarks). A cluster joined by address keeps its own settings:
    on KubeRay the rendered pods set `RAY_worker_niceness` instead. `address="local"`: a new
    Ray, even where an earlier `ray start` left its address behind (`ray.init()` would try
    to join that cluster, alive or not)."""
    return {"address": "local", "num_cpus": ray_config.num_cpus, "_metrics_export_port": ray_config.metrics_export_port,
            "_system_config": {"worker_niceness": ray_config.worker_niceness}}


def llm_config(resolved: Resolved, rp: ResolvedPool, *, scheduling_policy: str = "priority"):
    """The ray.serve.llm LLMConfig of one pool: its engine ceilings and placement."""
    from ray.serve.llm import LLMConfig

    m, e = resolved.config.model, rp.config.engine
    engine_kwargs = {
        "dtype": rp.dtype, "max_model_len": m.max_model_len, "max_num_seqs": e.max_num_seqs,
        "max_num_batched_tokens": e.max_num_batched_tokens, "enable_chunked_prefill": e.enable_chunked_prefill,
        "scheduling_policy": scheduling_policy, "enforce_eager": e.enforce_eager,
        "kv_cache_memory_bytes": int(e.kv_cache_gb * GIB), "disable_log_stats": False,
    }
    if e.block_size:
        engine_kwargs["block_size"] = e.block_size
    if m.quantization:
        engine_kwargs["quantization"] = m.quantization
    env = {**engine_env(), **({"VLLM_CPU_OMP_THREADS_BIND": e.cpu_threads_bind} if e.cpu_threads_bind else {})}
    return LLMConfig(
        model_loading_config={"model_id": m.id, "model_source": resolved.model_source},
        engine_kwargs=engine_kwargs,
        accelerator_config={"kind": e.accelerator},
        runtime_env={"env_vars": env} if env else None,
        deployment_config=pool_serve_options(rp, router_ongoing=resolved.config.router.max_ongoing_requests),
        log_engine_metrics=True,
    )


def pool_serve_options(rp: ResolvedPool, name: str | None = None, router_ongoing: int = 16) -> dict[str, Any]:
    """Serve options: room for the gate's whole queue plus its slots, and for the requests its
    own route holds before they reach the gate (`router_ongoing`: the router's bound), so Serve
    never queues in front of the gate; replica autoscaling tuned for slow-starting LLM replicas.
    They travel in the LLMConfig's `deployment_config`, where ray.serve.llm merges the
    engine's placement and runtime env into them."""
    c = rp.config
    r = c.replicas
    autoscaling = {
        "min_replicas": r.min, "max_replicas": r.max, "initial_replicas": max(r.min, 1),
        "target_ongoing_requests": r.target_ongoing_requests or float(rp.safe_range.high),
        "upscale_delay_s": r.upscale_delay_s, "downscale_delay_s": r.downscale_delay_s,
    }
    actor = {"num_cpus": r.num_cpus}
    if r.resources:
        actor["resources"] = dict(r.resources)
    return {
        "name": name or pool_deployment_name(rp.name),
        "max_ongoing_requests": c.queue.max_queued + c.engine.max_num_seqs + router_ongoing,
        "autoscaling_config": autoscaling,
        "ray_actor_options": actor,
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
    }


def pool_settings(resolved: Resolved, rp: ResolvedPool):
    from pools.server import PoolSettings

    c, a, m = rp.config, resolved.config.autoscale, resolved.config.model
    queue = QueuePolicy(
        max_queued=c.queue.max_queued,
        max_queued_tokens=c.queue.max_queued_tokens or c.queue.max_queued * m.max_model_len,
        max_wait_s=c.queue.max_wait_ms / 1e3,
        min_batch_tokens=c.queue.min_batch_tokens,
    )
    return PoolSettings(
        name=rp.name,
        start_seqs=rp.start_seqs,
        safe_range=rp.fallback,  # until the controller's first reply says which range the pool runs in
        ceilings=Ceilings(c.engine.max_num_seqs, rp.safe_range.max_inflight_tokens),
        queue=queue,
        report_interval_s=a.report_interval_s,
        latency_window_s=a.latency_window_s,
        stream_batching_ms=c.stream_batching_ms,
        fingerprint_base=fingerprint_base(resolved, rp),
        nice=c.replicas.nice,
        hardware=c.calibration.hardware,
        model_dtype=m.dtype,
        accelerator=c.engine.accelerator,
    )


def internal_logging(resolved: Resolved) -> dict[str, Any]:
    """Serve's logging for the controller, the ledger and the pools: their per-call access lines
    (several a second at rest: reports, views, syncs; a pool's route logs one line of its own
    per request) are off unless `ray.access_logs` asks for them."""
    return {"enable_access_log": resolved.config.ray.access_logs}


def closed_on_shutdown(cls: type) -> type:
    """`cls` with the `__del__` that Serve calls, awaiting what it returns, when it stops a
    replica: the replica's `close()` stops its background loops (and a pool's engine) there,
    then any `__del__` of `cls` runs (Serve's ingress wrapper shuts its ASGI app down in one).
    Only the first call does it: garbage collection calls `__del__` again and gets nothing to
    await."""
    def __del__(self):
        if self.__dict__.get("_closed_on_shutdown"):
            return None
        self._closed_on_shutdown = True
        base = getattr(super(closed, self), "__del__", None)

        async def shut_down() -> None:
            try:
                await self.close()
            finally:
                if base is not None and inspect.isawaitable(result := base()):
                    await result
        return shut_down()

    closed = type(cls.__name__, (cls,), {"__del__": __del__, "__qualname__": cls.__qualname__,
                                          "__module__": cls.__module__})
    return closed


def build_pool(resolved: Resolved, rp: ResolvedPool, app: str, pools: dict[str, Lookup]) -> Application:
    """A pool's application: its replicas answer HTTP at the pool's prefix themselves."""
    from deployments.pool_ingress import PoolIngress
    from pools.llm import deployment_options
    from router.ingress import POOL_ROUTES, make_app, routed

    config = llm_config(resolved, rp)
    options = {**deployment_options(config), "name": pool_deployment_name(rp.name),
               "logging_config": internal_logging(resolved)}
    http = make_app(f"poolserve {rp.name}")
    ingress = closed_on_shutdown(serve.ingress(http)(routed(http, PoolIngress, POOL_ROUTES)))
    return serve.deployment(ingress, **options).bind(
        llm_config=config, settings=pool_settings(resolved, rp),
        router=dataclasses.replace(router_settings(resolved), batches=None),  # the Batch API is the control app's
        prefix=rp.config.route_prefix.lstrip("/"), peers={p: h for p, h in pools.items() if p != rp.name},
        controller=Lookup(CONTROLLER, app), ledger=Lookup(LEDGER, app))


def pool_spec(rp: ResolvedPool, app: str = APP_NAME) -> PoolSpec:
    c = rp.config
    return PoolSpec(rp.name, rp.safe_range, c.slo.ttft_p99_ms / 1e3, c.slo.tpot_p99_ms / 1e3, c.engine.max_num_seqs,
                    fallback=rp.fallback, profile=rp.profile, calibration=c.calibration, sweep=rp.sweep,
                    deployment=pool_deployment_name(rp.name), app=pool_app_name(rp.name, app))


def profile_store(resolved: Resolved):
    """Where calibrated profiles are kept: the config's folder, else Ray's GCS key-value store."""
    return DirStore(resolved.profiles_dir) if resolved.profiles_dir else GcsStore(STATE_NAMESPACE)


def build_controller(resolved: Resolved, app: str) -> Application:
    specs = {name: pool_spec(rp, app) for name, rp in resolved.pools.items()}
    return serve.deployment(closed_on_shutdown(ControllerService), name=CONTROLLER, num_replicas=1,
                            max_ongoing_requests=10_000,
                            ray_actor_options={"num_cpus": 0}, logging_config=internal_logging(resolved)).bind(
        specs, resolved.config.autoscale, resolved.config.model.max_model_len, GcsStore(STATE_NAMESPACE),
        profile_store(resolved))


def build_ledger(resolved: Resolved) -> Application:
    quotas = {t.name: Quota(**t.quota.model_dump()) for t in resolved.config.tenants}
    return serve.deployment(LedgerService, name=LEDGER, num_replicas=1, max_ongoing_requests=10_000,
                            ray_actor_options={"num_cpus": 0}, logging_config=internal_logging(resolved)).bind(
        quotas, store=GcsStore(STATE_NAMESPACE))


def router_settings(resolved: Resolved):
    from router.app import RouterSettings
    from router.batch_api import BatchApiSettings
    from router.policy import PoolRoute

    c = resolved.config
    routes = []
    for name, rp in resolved.pools.items():
        b = rp.config.borrow
        routes.append(PoolRoute(
            name=name, prefix=rp.config.route_prefix.lstrip("/"),
            start_capacity=rp.start_seqs * max(1, rp.config.replicas.min),
            default_priority=PriorityClass.parse(rp.config.default_priority),
            borrow=BorrowRule(b.into, b.max_share, b.while_below_utilisation, b.after_quiet_s) if b else None,
            queue_slots=rp.config.queue.max_queued,
            max_num_seqs=rp.config.engine.max_num_seqs,
        ))
    batches = None
    if resolved.batches_dir is not None:
        batches = BatchApiSettings(str(resolved.batches_dir), resolved.batch_pool, c.batches.max_file_bytes,
                                   c.batches.max_lines, c.batches.max_uploads_per_tenant, c.batches.upload_timeout_s,
                                   c.batches.max_files_per_tenant, c.batches.max_stored_bytes_per_tenant)
    return RouterSettings(c.model.id, c.model.max_model_len, c.router, c.tenants, tuple(routes), batches)


def build_batches(resolved: Resolved) -> Application | None:
    """The Batch API's service (one replica), when `batches.dir` is set."""
    if resolved.batches_dir is None:
        return None
    from deployments.batch_cli import RayJobRunner
    from router.batch_service import BatchService
    from router.batches import BatchSettings

    c = resolved.config
    settings = BatchSettings(resolved.batches_dir, c.batches.router_url or f"http://127.0.0.1:{c.router.port}",
                             resolved.pools[resolved.batch_pool].config.route_prefix.lstrip("/"),
                             c.batches.concurrency, c.batches.max_attempts, c.batches.max_lines,
                             c.batches.max_active_per_tenant,
                             {t.name: t.quota.max_concurrent for t in c.tenants if t.quota.max_concurrent})
    return serve.deployment(closed_on_shutdown(BatchService), name=BATCHES, num_replicas=1, max_ongoing_requests=1000,
                            ray_actor_options={"num_cpus": 0}, logging_config=internal_logging(resolved)).bind(
        settings, RayJobRunner(c.batches.dashboard_url), c.batches.poll_interval_s)


def build_router(resolved: Resolved, pools: dict[str, Lookup], controller: Application,
                 ledger: Application, batches: Application | None = None) -> Application:
    from router.ingress import make_app, route_class

    c = resolved.config.router
    app = make_app()
    ingress = closed_on_shutdown(serve.ingress(app)(route_class(app)))
    renderer = llm_config(resolved, next(iter(resolved.pools.values())))  # the pools share model and template
    return serve.deployment(ingress, name=ROUTER, num_replicas=c.replicas, max_ongoing_requests=c.max_ongoing_requests,
                            ray_actor_options={"num_cpus": 0.5}).bind(
        router_settings(resolved), pools, controller, ledger, renderer, batches)


def build_apps(resolved: Resolved, app: str = APP_NAME) -> dict[str, RunTarget]:
    """The control application (`control`) and one per pool (by the pool's name)."""
    pools = {name: Lookup(pool_deployment_name(name), pool_app_name(name, app)) for name in resolved.pools}
    control = build_router(resolved, pools, build_controller(resolved, app), build_ledger(resolved),
                           build_batches(resolved))
    out = {"control": RunTarget(control, app, "/")}
    for name, rp in resolved.pools.items():
        out[name] = RunTarget(build_pool(resolved, rp, app, pools), pool_app_name(name, app), rp.config.route_prefix)
    return out


def deploy(resolved: Resolved, app: str = APP_NAME) -> None:
    """Run every application of `resolved` at once (engines start side by side) and wait
    until all are running."""
    serve.run_many(list(build_apps(resolved, app).values()))


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application-builder entry point (`serve run deployments.app:app_builder`):
    `args["part"]` names the application (`control`, the default, or a pool's name) and
    `args["name"]` the control application's name (its pools' follow from it)."""
    if "config_path" in args:
        resolved = load(args["config_path"])
    else:
        config = parse(args["config"], "serveConfigV2 args.config")
        resolved = resolve(config, Path(args.get("base_dir", ".")), "serveConfigV2 args.config")
    apps = build_apps(resolved, args.get("name", APP_NAME))
    part = args.get("part", "control")
    if part not in apps:
        raise ValueError(f"app_builder args.part is {part!r}; it is 'control' or a pool: {', '.join(resolved.pools)}")
    return apps[part].target
