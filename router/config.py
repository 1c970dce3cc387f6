"""Typed configuration of tenants, of the router and of its Batch API (the `tenants:`, `router:` and
`batches:` keys)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from pools.config import Frozen
from pools.types import PriorityClass
from router.quota import HOLDER_TTL_S

MAX_LEASE_TTL_S = HOLDER_TTL_S / 3  # the longest sync interval: a live replica may miss two before it is taken for dead

PriorityName = Literal["interactive", "standard", "batch"]


class QuotaConfig(Frozen):
    """Per-tenant limits, enforced before work starts. `None` means unlimited."""

    requests_per_min: int | None = Field(None, ge=1, description="Requests a minute (a token bucket).")
    tokens_per_min: int | None = Field(
        None, ge=1, description="Tokens a minute, charged before work starts as every prompt token plus `n` x "
                                "`max_tokens` (unset: the rest of the context for chat, 16 for completions), then "
                                "settled by the real usage.")
    max_concurrent: int | None = Field(
        None, ge=1, description="Requests in flight at once, charged before the body is read: a request of `n` "
                                "choices is one (its `n` sequences are paid for in tokens, and the pool's gate "
                                "counts them as `n`).")


class TenantConfig(Frozen):
    name: str = Field(description="Tenant name in metrics and logs.")
    key_sha256: str | None = Field(
        None, description="SHA-256 (hex) of the tenant's API key; the key itself is never stored. Unset: the key "
                          "is read at start from `router.keys_dir` (a mounted Secret).")
    pools: tuple[str, ...] = Field(min_length=1, description="Pools this key may use.")
    default_pool: str | None = Field(None, description="Pool for /v1/... (default: the first of `pools`).")
    priority: PriorityName | None = Field(None, description="Default class (default: the pool's).")
    max_priority: PriorityName | None = Field(
        None, description="Most important class a request may ask for (default: its default class).")
    weight: float = Field(1.0, gt=0, le=1000, description="Share of tokens under contention inside a class.")
    quota: QuotaConfig = Field(default_factory=QuotaConfig, description="See below.")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,62}", v):
            raise ValueError(f"{v!r} must be lowercase letters, digits, '-' or '_'")
        if v in ("admin", "hf-token"):  # files of router.keys_dir (the Secret) that hold other keys
            raise ValueError(f"{v!r} names another key's file in router.keys_dir; give the tenant another name")
        return v

    @field_validator("key_sha256")
    @classmethod
    def _hex(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[0-9a-f]{64}", v):
            raise ValueError("must be 64 lowercase hex digits: the output of "
                             "`printf %s KEY | sha256sum` (or `poolserve hash-key KEY`)")
        return v

    @model_validator(mode="after")
    def _defaults(self) -> "TenantConfig":
        if self.default_pool is not None and self.default_pool not in self.pools:
            raise ValueError(f"default_pool {self.default_pool!r} is not in pools {list(self.pools)}; "
                             "add it to pools or pick one of them")
        if self.priority and self.max_priority and \
                PriorityClass.parse(self.max_priority) > PriorityClass.parse(self.priority):
            raise ValueError(f"max_priority {self.max_priority!r} is less important than priority "
                             f"{self.priority!r}; the ceiling must be at least the default class")
        return self

    @property
    def home_pool(self) -> str:
        return self.default_pool or self.pools[0]

    def ceiling(self, pool_default: PriorityClass) -> PriorityClass:
        """The most important class this tenant may have on a pool: `max_priority` when set,
        else its default class there."""
        if self.max_priority:
            return PriorityClass.parse(self.max_priority)
        return PriorityClass.parse(self.priority) if self.priority else pool_default

    def default_class(self, pool_default: PriorityClass) -> PriorityClass:
        """Its class when a request asks for none: its own default or the pool's, never more
        important than its ceiling."""
        own = PriorityClass.parse(self.priority) if self.priority else pool_default
        return max(own, self.ceiling(pool_default))  # a larger value is less important


class RouterConfig(Frozen):
    host: str = Field("127.0.0.1", description="Bind address; 0.0.0.0 only behind a trusted network.")
    port: int = Field(8000, ge=1, le=65535)
    replicas: int = Field(1, ge=1, description="Router replicas; quotas hold across them (shared ledger).")
    max_ongoing_requests: int = Field(
        4096, ge=1, description="Per router replica; large so that Serve never queues in front of it.")
    max_body_bytes: int = Field(1 << 20, ge=1024, description="Larger bodies get 413.")
    body_timeout_s: float = Field(
        30.0, gt=0, description="A request body must arrive within this long (else 408), so a slow upload cannot "
                                "hold the router; it is read after the request and its concurrency slot are "
                                "charged to the tenant.")
    max_json_depth: int = Field(64, ge=4, le=1000, description="Deeper nesting of lists and objects gets 400.")
    max_grammar_bytes: int = Field(
        64 << 10, ge=1024, description="A request's structured-output spec (`response_format`, `structured_outputs`, "
                                       "the tools when `tool_choice` forces a call) above this size gets 400: the "
                                       "engine converts and compiles all of it before the first token.")
    max_pattern_repeats: int = Field(
        256, ge=0, description="The places a request's JSON-schema patterns, plain regexes and EBNF grammars can "
                               "leave out or repeat (`?`, `*`, `+`, empty alternatives, each `{m,n}`'s n - m in a "
                               "schema's pattern and one elsewhere; four times on `.` or a negated class; times "
                               "those of the groups around them), summed, above this get 400 (so do patterns over "
                               "4,096 characters, groups nested over 16 deep, and counts that cost more to convert "
                               "than one `{512}`): the engine compiles them before the first token, in time growing "
                               "faster than they do (64 `.?`: 0.38 s on the tiny model, 128: 2 s), and xgrammar "
                               "converts a count on the event loop that serves the pool (`.{1,8000}` stalled a pool "
                               "for 19 s).")
    reach_timeout_s: float = Field(
        15.0, gt=0, description="How long a request may wait to reach a pool replica (one is restarting, say) "
                                "before it gets 503 with Retry-After. Waiting in a pool's queue is not counted.")
    idle_timeout_s: float = Field(
        600.0, gt=0, description="How long an admitted request may wait for its pool's next output (the first "
                                 "token, the next chunk, or a whole response) before it fails with 504 "
                                 "`pool_timeout` (a started stream: an error event) and its pool call is cancelled, "
                                 "giving back its slot and its tenant's: a replica that stays up while its engine "
                                 "hangs would hold them for ever. The OpenAI SDK gives up after 600 s by default; "
                                 "raise it with clients that wait longer for whole responses on slow hardware.")
    admin_key_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                                         description="SHA-256 of the admin key; unset (and no `admin` file in "
                                                     "`keys_dir`) disables /admin.")
    keys_dir: str | None = Field(
        None, description="A folder (a mounted Kubernetes Secret) of files named after tenants, and `admin`, each "
                          "holding that key: read at start, hashed, and used instead of the hashes in the config, "
                          "so no key or hash is baked into the Serve config.")
    log_prompts: bool = Field(False, description="Log prompt text (off: only sizes and outcomes are logged).")
    lease_fraction: float = Field(0.1, gt=0, le=1, description="Share of a quota one lease may take.")
    lease_ttl_s: float = Field(
        5.0, gt=0, le=MAX_LEASE_TTL_S,
        description=f"How often a replica syncs its leases with the ledger (unused balances go back); at most "
                    f"{MAX_LEASE_TTL_S:g} s, as the ledger gives away the slots of a replica it has not heard from "
                    f"for {HOLDER_TTL_S:g} s, running requests and all.")
    pool_view_interval_s: float = Field(1.0, gt=0, description="How often the router refreshes pool load.")
    view_max_age_s: float = Field(
        5.0, gt=0, description="A pool view older than this (the controller stopped answering) counts as unknown: "
                               "no borrowing and no shedding at the router until a fresh one arrives.")


class BatchesConfig(Frozen):
    """The OpenAI Batch API (`/v1/files`, `/v1/batches`): each batch a Ray job of the batch
    runner, through `pool` under the tenant's own key."""

    dir: str | None = Field(
        None, description="Where tenants' files and batches are kept (relative to the config file): a folder "
                          "every router replica and the head node see (on Kubernetes, `poolserve k8s render` mounts "
                          "a ReadWriteMany volume there on every pod). Unset: the Batch API is off (its paths answer "
                          "404).")
    pool: str | None = Field(None, description="The pool batches run on (default: the first pool whose "
                                               "default_priority is batch).")
    router_url: str | None = Field(None, description="Where the batch jobs reach the router (default: "
                                                     "http://127.0.0.1:<router.port>, the head node's own proxy).")
    dashboard_url: str = Field("http://127.0.0.1:8265", description=(
        "Ray's job API, where batches are submitted. Unset, `poolserve serve` takes the dashboard of the Ray it "
        "starts (8265, or the first free port after it). Ray's job client takes `RAY_API_SERVER_ADDRESS` or "
        "`RAY_ADDRESS` over it where either is set, as KubeRay sets the latter in every pod (its own cluster's "
        "head)."))
    concurrency: int = Field(64, ge=1, le=4096, description="Requests each batch keeps outstanding (no more than its "
                                                            "tenant's `quota.max_concurrent`).")
    max_file_bytes: int = Field(200 << 20, ge=1024, description="Larger files get 413 (the form around one is not "
                                                                "counted).")
    max_lines: int = Field(50_000, ge=1, description="Requests one batch may hold (OpenAI's limit).")
    max_attempts: int = Field(3, ge=1, le=20, description="Times a batch's job is started before the batch fails.")
    max_active_per_tenant: int = Field(8, ge=1, description="Batches one tenant may have unfinished at once (each "
                                       "runs as a Ray job); a create beyond gets 429 until one ends or is cancelled.")
    max_uploads_per_tenant: int = Field(2, ge=1, description="Uploads one tenant may have arriving at a router "
                                        "replica at once; more get 429 (each holds a connection and one of the "
                                        "replica's `max_ongoing_requests` while it arrives).")
    upload_timeout_s: float = Field(600.0, gt=0, description="A file must arrive within this long, else 408 (200 MiB "
                                                             "in 600 s is 2.8 Mbit/s).")
    max_files_per_tenant: int = Field(10_000, ge=1, description="Files one tenant may keep (its uploads and its "
                                      "batches' outputs); an upload beyond gets 413 until it deletes some.")
    max_stored_bytes_per_tenant: int = Field(10 << 30, ge=1024, description="Bytes of files one tenant may keep on "
                                             "the volume (its batches' outputs, always written, included); an upload "
                                             "beyond gets 413. Uploads arriving at once may each pass: size the "
                                             "volume for the tenants' sum plus max_uploads_per_tenant files each per "
                                             "router replica.")
    poll_interval_s: float = Field(2.0, gt=0, description="How often batches move on (their jobs are checked).")

    @property
    def names_job_api(self) -> bool:
        """Whether the config names the job API (else `poolserve serve` uses its own Ray's)."""
        return "dashboard_url" in self.model_fields_set
