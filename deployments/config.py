"""The whole configuration: one YAML file, loaded once into frozen models, then checked
against itself and resolved into what the builders need.

Every problem is reported with the key, the value and the fix; `load` collects them all
before raising, so `poolserve validate` shows a whole list at once. Relative paths
(model source, profiles) are relative to the config file's directory.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator

from autoscale.config import AutoscaleConfig
from autoscale.profile import Profile, load_profile
from pools.config import POOL_NAME, Frozen, ModelConfig, PoolConfig
from pools.engine import pool_dtype, read_hf_config
from pools.kv_budget import GIB, KVBudget, ModelShape
from pools.types import SafeRange
from router.auth import KEY_FIX
from router.config import BatchesConfig, RouterConfig, TenantConfig


class RayConfig(Frozen):
    """The local Ray started by `poolserve serve` (ignored when `address` names a cluster)."""

    address: str | None = Field(None, description="Join this cluster instead of starting one.")
    num_cpus: int = Field(8, ge=1, description="Logical CPUs; more than the cores so every actor schedules.")
    metrics_export_port: int = Field(8080, ge=1, le=65535, description="Ray's Prometheus endpoint (else the next free).")
    dashboard: bool = Field(False, description="Start the dashboard (needed for job submission).")
    access_logs: bool = Field(
        False, description="Serve's access line for every call between deployments (reports, views, quota "
                           "syncs: several a second at rest). Off: the console shows what people need.")
    worker_niceness: int = Field(
        0, ge=0, le=19, description="Linux nice of Ray's worker processes (Serve replicas, the HTTP proxy, "
                                    "engines). Ray's own default, 15, ranks the whole serving path below any "
                                    "ordinary process on the host; a pool's `replicas.nice` counts from this.")
    haproxy: bool = Field(
        False, description="Serve's HTTP entry is HAProxy (Ray Serve's direct ingress) instead of its Python "
                           "proxy: one process less on every request (bench/notes.md measured the gain). Off by "
                           "default: in Ray 2.60 HAProxy does not pass a client's disconnect on to the replica, so "
                           "an abandoned request runs to its end, and after a burst of abandoned requests it spun "
                           "at full CPU until they finished. A cluster poolserve joins keeps its own setting "
                           "(`RAY_SERVE_ENABLE_HA_PROXY=1` where `ray start` runs).")


class ProfilesConfig(Frozen):
    """Where calibrated profiles are kept, one per fingerprint of a pool's set-up."""

    dir: str | None = Field(
        None, description="A folder (relative to the config file), which outlives the cluster: the project's "
                          "cache on one machine, a volume on Kubernetes. Unset: Ray's GCS key-value store (kept "
                          "across head restarts where KubeRay's GCS fault tolerance is on).")


class PoolserveConfig(Frozen):
    model: ModelConfig
    router: RouterConfig = RouterConfig()
    ray: RayConfig = RayConfig()
    pools: dict[str, PoolConfig] = Field(min_length=1)
    tenants: tuple[TenantConfig, ...] = Field(min_length=1)
    autoscale: AutoscaleConfig = AutoscaleConfig()
    profiles: ProfilesConfig = ProfilesConfig()
    batches: BatchesConfig = BatchesConfig()

    @field_validator("pools")
    @classmethod
    def _names(cls, v: dict[str, PoolConfig]) -> dict[str, PoolConfig]:
        for name in v:
            if not POOL_NAME.match(name):
                raise ValueError(f"pool name {name!r} must be lowercase letters, digits and '-', starting with a "
                                 "letter, and not 'control' (it names a Serve application)")
        return v


@dataclass(frozen=True)
class Problem:
    key: str
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        value = json.dumps(self.value, default=str)
        if len(value) > 80:
            value = value[:77] + "..."
        return f"{self.key}: {value}: {self.message}. Fix: {self.fix}"


class ConfigError(ValueError):
    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source, self.problems = source, problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


@dataclass(frozen=True)
class ResolvedPool:
    """A pool with its paths resolved, its profile loaded and its range settled."""

    name: str
    config: PoolConfig
    safe_range: SafeRange
    start_seqs: int
    profile: Profile | None
    kv_capacity_tokens: int | None
    fallback: SafeRange  # where a pool with no profile for its set-up runs: the ladder up to `start`
    sweep: tuple[int, ...] = ()  # the ladder a calibration of this pool steps through
    dtype: str = "auto"  # what its engines are asked for (`engine_dtype`)


@dataclass(frozen=True)
class Resolved:
    config: PoolserveConfig
    base_dir: Path
    model_source: str
    pools: dict[str, ResolvedPool]
    warnings: tuple[str, ...] = ()
    profiles_dir: Path | None = None  # where calibrated profiles are kept (None: Ray's GCS key-value store)
    batches_dir: Path | None = None  # the Batch API's files (None: the Batch API is off)
    batch_pool: str | None = None


# -- loading ------------------------------------------------------------------------

_FIXES = {
    "extra_forbidden": "remove it, or check its spelling against docs/configuration.md",
    "missing": "add it",
    "greater_than": "raise it", "greater_than_equal": "raise it",
    "less_than": "lower it", "less_than_equal": "lower it",
    "literal_error": "use one of the values listed",
    "string_pattern_mismatch": "match the pattern shown",
    "too_short": "add at least one entry",
}


def _problems_from(e: ValidationError) -> list[Problem]:
    out = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "tagged-union")))
        fix = _FIXES.get(err["type"], "correct the value")
        msg = err["msg"].removeprefix("Value error, ")
        out.append(Problem(loc or "(top level)", err.get("input"), msg, fix))
    return out


def parse(data: Any, source: str = "config") -> PoolserveConfig:
    if not isinstance(data, dict):
        raise ConfigError(source, [Problem("(top level)", data, "the config must be a mapping", "see "
                                           "deployments/configs/local.yaml for an example")])
    problems = _not_finite(data)
    try:
        config = PoolserveConfig.model_validate(data)
    except ValidationError as e:
        problems += [p for p in _problems_from(e) if p.key not in {q.key for q in problems}]
    if problems:
        raise ConfigError(source, problems)
    return config


def _not_finite(data: Any, at: tuple = ()) -> list[Problem]:
    """YAML's .inf and .nan, wherever they are: an infinite SLO failed the autoscaler at run time."""
    if isinstance(data, float) and not math.isfinite(data):
        return [Problem(".".join(map(str, at)), data, "must be a finite number", "give a number, or leave it out")]
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    return [p for k, v in items for p in _not_finite(v, (*at, k))]


def read_yaml(path: str | Path) -> Any:
    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.YAMLError as e:
        raise ConfigError(str(path), [Problem("(file)", str(path), f"not valid YAML: {e}", "fix the syntax")])
    except OSError as e:
        raise ConfigError(str(path), [Problem("(file)", str(path), f"cannot read: {e.strerror}",
                                              "check the path")])


def load(path: str | Path, router: dict | None = None) -> Resolved:
    """Read, parse, check and resolve a config file, `router` settings of the command line over
    the file's (checked alike); raise ConfigError with every problem."""
    path, data = Path(path), read_yaml(path)
    if router and isinstance(data, dict) and isinstance(data.get("router", {}), dict):  # else parse() says why
        data = {**data, "router": {**(data.get("router") or {}), **router}}
    config = parse(data, str(path))
    return resolve(config, path.resolve().parent, str(path))


# -- checks across sections -----------------------------------------------------------

def _path(base: Path, p: str) -> Path:
    q = Path(p)
    return q if q.is_absolute() else base / q


# Keys poolserve itself ships, in examples, the development config and the tests: anyone can
# read them, so a server that other machines reach must not accept them.
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _shipped(c: PoolserveConfig, key: str, digest: str | None, out: list[Problem], local: list[str]) -> None:
    from router.auth import SHIPPED_KEYS, sha256_hex

    example = next((k for k in SHIPPED_KEYS if digest == sha256_hex(k)), None)
    if example is None:
        return
    if c.router.host in LOOPBACK:
        local.append(example)
    else:
        out.append(Problem(key, digest[:12] + "...", f"is the hash of {example!r}, a key poolserve ships in its "
                                                     f"examples, on a router other machines reach (router.host "
                                                     f"{c.router.host})", KEY_FIX))


def _check_tenants(c: PoolserveConfig, warnings: list[str]) -> list[Problem]:
    out, local = [], []
    names, hashes = set(), {c.router.admin_key_sha256}
    _shipped(c, "router.admin_key_sha256", c.router.admin_key_sha256, out, local)
    for i, t in enumerate(c.tenants):
        key = f"tenants[{i}]"
        if t.name in names:
            out.append(Problem(f"{key}.name", t.name, "duplicate tenant name", "give each tenant its own name"))
        if t.key_sha256 is None and c.router.keys_dir is None:
            out.append(Problem(f"{key}.key_sha256", None, f"tenant {t.name!r} has no key",
                               f"set key_sha256 ({KEY_FIX}), or router.keys_dir to a folder holding a file "
                               f"named {t.name!r}"))
        if t.key_sha256 is not None and t.key_sha256 in hashes:
            out.append(Problem(f"{key}.key_sha256", t.key_sha256[:12] + "...", "another tenant or the admin has "
                               "this key", "give each tenant its own key, and the admin another"))
        _shipped(c, f"{key}.key_sha256", t.key_sha256, out, local)
        names.add(t.name)
        hashes.add(t.key_sha256)
        for pool in t.pools:
            if pool not in c.pools:
                out.append(Problem(f"{key}.pools", list(t.pools), f"unknown pool {pool!r}",
                                   f"use pools defined under pools: {sorted(c.pools)}"))
    if local:
        warnings.append(f"the example keys {', '.join(local)} are accepted: fine while the router listens on "
                        f"{c.router.host} only")
    return out


def _check_pool(c: PoolserveConfig, name: str, p: PoolConfig) -> list[Problem]:
    key, out = f"pools.{name}", []
    if p.borrow is not None:
        if p.borrow.into not in c.pools or p.borrow.into == name:
            out.append(Problem(f"{key}.borrow.into", p.borrow.into, "must name another pool",
                               f"use one of {sorted(set(c.pools) - {name})}"))
    if p.traffic.p99_tokens > c.model.max_model_len:
        out.append(Problem(f"{key}.traffic.p99_tokens", p.traffic.p99_tokens,
                           f"above model.max_model_len {c.model.max_model_len}", "lower it or raise max_model_len"))
    if p.queue.max_queued_tokens is not None and p.queue.max_queued_tokens < c.model.max_model_len:
        out.append(Problem(f"{key}.queue.max_queued_tokens", p.queue.max_queued_tokens,
                           f"smaller than one full-length request ({c.model.max_model_len} tokens)",
                           "raise it to at least model.max_model_len"))
    if not p.engine.enable_chunked_prefill and p.engine.max_num_batched_tokens < c.model.max_model_len:
        out.append(Problem(f"{key}.engine.max_num_batched_tokens", p.engine.max_num_batched_tokens,
                           "below max_model_len with chunked prefill off: long prompts could never run",
                           "raise it to max_model_len or enable_chunked_prefill: true"))
    if p.limits.range is not None and p.limits.range[1] > p.engine.max_num_seqs:
        out.append(Problem(f"{key}.limits.range", list(p.limits.range),
                           f"top {p.limits.range[1]} is above engine.max_num_seqs {p.engine.max_num_seqs}",
                           "lower the range top or raise engine.max_num_seqs"))
    return out


def _pool_range(c: PoolserveConfig, name: str, p: PoolConfig, base: Path, kv: KVBudget | None,
                problems: list[Problem]) -> ResolvedPool | None:
    key = f"pools.{name}.limits"
    profile = None
    if p.limits.profile is not None:
        path = _path(base, p.limits.profile)
        try:
            profile = load_profile(path)
        except (OSError, ValueError) as e:
            problems.append(Problem(f"{key}.profile", p.limits.profile, f"cannot load the profile: {e}",
                                    "run `poolserve calibrate` to write it, or give `range` instead"))
            return None
        ladder, (low, high) = profile.ladder, profile.range
        if high > p.engine.max_num_seqs:
            problems.append(Problem(f"{key}.profile", p.limits.profile,
                                    f"its range top {high} is above engine.max_num_seqs {p.engine.max_num_seqs}",
                                    "recalibrate with this pool's ceilings"))
            return None
    else:
        ladder, (low, high) = p.limits.ladder, p.limits.range
    start = p.limits.start or low
    if start not in ladder or start > p.engine.max_num_seqs or (p.limits.range is not None and start > high):
        problems.append(Problem(f"{key}.start", start, f"not a ladder step of at most engine.max_num_seqs "
                                                      f"{p.engine.max_num_seqs}" + (
                                                          f" inside the range [{low}, {high}]" if p.limits.range
                                                          else "") + f" (ladder {list(ladder)})",
                                "pick one of those steps"))
        return None
    tokens_per_seq = p.limits.tokens_per_seq or p.traffic.p99_tokens
    cap = kv.capacity_tokens if kv is not None else high * c.model.max_model_len
    seq_cap = p.engine.max_num_seqs * c.model.max_model_len
    max_inflight = max(c.model.max_model_len, min(cap, seq_cap))
    safe = SafeRange(tuple(ladder), low, high, tokens_per_seq, max_inflight)
    fits = kv.max_sequences(p.traffic.p99_tokens) if kv is not None else p.engine.max_num_seqs
    usable = [x for x in ladder if low <= x <= min(start, fits)] or [low]
    fallback = SafeRange(tuple(ladder), low, usable[-1], tokens_per_seq, max_inflight)
    sweep = tuple(x for x in (p.calibration.ladder or ladder) if x <= min(p.engine.max_num_seqs, fits))
    if kv is not None:
        if fits < high:
            problems.append(Problem(
                f"pools.{name}.engine.kv_cache_gb", p.engine.kv_cache_gb,
                f"the KV cache holds {fits} sequences at the p99 length of {p.traffic.p99_tokens} tokens "
                f"({kv.shape.bytes_per_token} bytes/token, {kv.capacity_tokens} tokens), fewer than the "
                f"range top {high}", f"raise kv_cache_gb or keep the range top at {fits} or below"))
            return None
    return ResolvedPool(name, p, safe, start, profile, kv.capacity_tokens if kv else None, fallback, sweep)


def batch_pool(c: PoolserveConfig) -> str | None:
    """The pool batches run on: `batches.pool`, else the first pool of class batch."""
    return c.batches.pool or next((n for n, p in c.pools.items() if p.default_priority == "batch"), None)


def _check_batches(c: PoolserveConfig) -> list[Problem]:
    if c.batches.dir is None:
        return []
    pool = batch_pool(c)
    if pool not in c.pools:
        return [Problem("batches.pool", c.batches.pool, "names no pool" if c.batches.pool else
                        "no pool has default_priority batch to run batches on", f"name one of {sorted(c.pools)}")]
    return []


RAY_AGENT_PORT = 52365  # Ray's dashboard agent's, on every node it starts (DEFAULT_DASHBOARD_AGENT_LISTEN_PORT)


def resolve(config: PoolserveConfig, base_dir: Path, source: str = "config") -> Resolved:
    warnings: list[str] = []
    problems = _check_tenants(config, warnings) + _check_batches(config)
    for name, p in config.pools.items():
        problems += _check_pool(config, name, p)
    prefixes = [p.route_prefix for p in config.pools.values()]
    for name, p in config.pools.items():
        if prefixes.count(p.route_prefix) > 1:
            problems.append(Problem(f"pools.{name}.route_prefix", p.route_prefix, "taken by another pool",
                                    "give each pool its own prefix"))
    source_path = _path(base_dir, config.model.source)
    model_source = str(source_path) if source_path.exists() else config.model.source
    hf = read_hf_config(source_path)
    if hf is None:
        warnings.append(f"model.source {config.model.source!r} has no local config.json: the KV budget check "
                        "is skipped (it runs where the model directory exists)")
    pools = {}
    for name, p in config.pools.items():
        dtype, slow = pool_dtype(config.model.dtype, p.engine.accelerator, hf, config.model.quantization)
        if slow and slow not in warnings:
            warnings.append(slow)
        shape = ModelShape.from_hf_config(hf, dtype) if hf is not None else None
        kv = KVBudget(shape, int(p.engine.kv_cache_gb * GIB), p.engine.block_size or 16) if shape else None
        rp = _pool_range(config, name, p, base_dir, kv, problems)
        if rp is not None:
            pools[name] = dataclasses.replace(rp, dtype=dtype)
    if config.router.admin_key_sha256 is None and config.router.keys_dir is None:
        warnings.append("router.admin_key_sha256 is not set: the admin API is disabled")
    if problems:
        raise ConfigError(source, problems)
    profiles_dir = _path(base_dir, config.profiles.dir) if config.profiles.dir else None
    batches_dir = _path(base_dir, config.batches.dir) if config.batches.dir else None
    return Resolved(config, base_dir, model_source, pools, tuple(warnings), profiles_dir, batches_dir,
                    batch_pool(config))


def local_ray_problems(resolved: Resolved) -> list[Problem]:
    """Ports the Ray that `poolserve serve` starts itself would find taken by its own parts (a
    config that joins a cluster, or a manifest for one, binds none of them)."""
    c = resolved.config
    out = [Problem(key, port, "is taken by Ray's dashboard agent, which the Ray poolserve starts runs there",
                   "choose another port") for key, port in (("router.port", c.router.port),
                                                          ("ray.metrics_export_port", c.ray.metrics_export_port))
           if port == RAY_AGENT_PORT]
    if c.ray.metrics_export_port == c.router.port:
        out.append(Problem("ray.metrics_export_port", c.ray.metrics_export_port, "is router.port too: the router "
                           "and Ray's metrics cannot both listen on it", "give Ray's metrics another port (8080 by "
                           "default)"))
    return out


def local_jobs_problem(resolved: Resolved) -> str | None:
    """Why the Batch API could not submit its jobs on a Ray that poolserve starts, if so: only
    the dashboard serves Ray's job API."""
    c = resolved.config
    if resolved.batches_dir is None or c.ray.dashboard or c.batches.names_job_api:
        return None
    return ("batches.dir turns the Batch API on, and each batch runs as a Ray job, but ray.dashboard is false: "
            "the Ray that poolserve starts would have no job API. Set ray.dashboard: true, or "
            "batches.dashboard_url to a job API elsewhere, or leave batches.dir unset.")
