"""Both pools answer chat and streamed completions through the router, on their own replicas."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.integration.conftest import MODEL, wait_for

pytestmark = pytest.mark.integration

POOLS = [("online", "online-chat", "chat"), ("offline", "offline-batch", "batch")]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(MODEL))


@pytest.mark.parametrize("prefix, pool, tenant", POOLS, ids=[p[1] for p in POOLS])
def test_chat_completion_usage_and_replica(stack, tokenizer, prefix, pool, tenant):
    before = stack.fresh_replica(pool)["admitted"]
    messages = [{"role": "user", "content": "How many tokens fit in the batch queue today?"}]
    raw = stack.client(tenant, prefix).chat.completions.with_raw_response.create(
        model="tiny-llama", messages=messages, max_tokens=12, extra_body={"ignore_eos": True})
    r = raw.parse()
    expected_prompt = len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"])
    assert r.usage.prompt_tokens == expected_prompt
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == expected_prompt + 12
    assert r.choices[0].message.content
    assert raw.headers["x-poolserve-pool"] == pool
    assert raw.headers["x-poolserve-replica"] in {x["replica"] for x in stack.pools()[pool]["replicas"]}
    wait_for(lambda: stack.replica(pool)["admitted"] >= before + 1, 10, what=f"{pool} counts the request")


@pytest.mark.parametrize("prefix, pool, tenant", POOLS, ids=[p[1] for p in POOLS])
def test_streamed_completion_usage_and_replica(stack, tokenizer, prefix, pool, tenant):
    other = "offline-batch" if pool == "online-chat" else "online-chat"
    other_before = stack.fresh_replica(other)["admitted"]
    prompt = "Stream eight tokens about the offline queue"
    raw = stack.client(tenant, prefix).completions.with_raw_response.create(
        model="tiny-llama", prompt=prompt, max_tokens=8, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(raw.parse())
    text_chunks = [c for c in chunks if c.choices and c.choices[0].text]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1
    assert usage[0].prompt_tokens == len(tokenizer.encode(prompt))
    assert usage[0].completion_tokens == 8
    assert 1 <= len(text_chunks) <= 8
    assert raw.headers["x-poolserve-pool"] == pool
    assert raw.headers["x-poolserve-replica"] in {x["replica"] for x in stack.pools()[pool]["replicas"]}
    assert stack.fresh_replica(other)["admitted"] == other_before  # nothing ran on the other pool
    steps = dict(part.split(";dur=") for part in raw.headers["server-timing"].split(", "))
    assert list(steps) == ["router", "reach", "queue", "engine"] and all(float(v) >= 0 for v in steps.values())


def test_stream_without_usage_request_gets_no_usage_chunk(stack):
    stream = stack.client("chat").chat.completions.create(
        model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_default_pool_models_and_health(stack):
    import httpx

    r = stack.client("batch", pool=None).completions.with_raw_response.create(
        model="tiny-llama", prompt="default pool", max_tokens=2)
    assert r.headers["x-poolserve-pool"] == "offline-batch"  # batch's first pool
    models = stack.client("chat").models.list()
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert httpx.get(f"{stack.base_url}/healthz").json()["status"] == "ok"


def test_pools_run_at_their_configured_cpu_priority(stack):
    """Ray's workers at the config's worker niceness (0, not Ray's 15); the offline pool's
    replica and every engine process under it at its `replicas.nice` (10 in this config)."""
    offline = stack.admin("GET", "/admin/pools/offline-batch/describe").json()["nice"]
    online = stack.admin("GET", "/admin/pools/online-chat/describe").json()["nice"]
    assert online["replica"] == 0 and len(online["engines"]) >= 2 and set(online["engines"]) == {0}
    assert offline["replica"] == 10
    assert len(offline["engines"]) >= 2 and set(offline["engines"]) == {10}  # engine core and its worker


def test_each_pools_engine_core_runs_beside_its_workers(stack):
    """vLLM binds a CPU engine's workers to the pool's `cpu_threads_bind` (cores 0 and 1 in
    this config) and leaves its engine core, which busy-waits for them, free to run anywhere:
    the pool binds the engine core beside them."""
    for pool, core in (("online-chat", 0), ("offline-batch", 1)):
        cores = stack.admin("GET", f"/admin/pools/{pool}/describe").json()["engine_cores"]
        assert len(cores) >= 2 and all(c == [core] for c in cores), (pool, cores)
