"""The one adapter onto Ray LLM's private internals (`ray.llm._internal`) and vLLM.

Every use of a private Ray LLM name lives here, so a Ray upgrade is checked in one file.
vLLM and Ray LLM are imported lazily: importing this module costs nothing, and the pure
code and its tests never load them.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, NamedTuple

from infra.bounds import within
from pools.types import CountedPrompt

log = logging.getLogger("poolserve.pool")


def request_models() -> tuple[type, type]:
    """The OpenAI request models ray.serve.llm validates with (vLLM's): (chat, completions)."""
    from ray.serve.llm.openai_api_models import ChatCompletionRequest, CompletionRequest

    return ChatCompletionRequest, CompletionRequest


def sanitize_chat(body: Any) -> Any:
    """What ray.serve.llm's ingress does to a chat request before it crosses to a replica:
    one-shot iterators in `content` and `tool_calls` become lists, so the request pickles."""
    from ray.llm._internal.serve.core.ingress.utils import _sanitize_chat_completion_request

    return _sanitize_chat_completion_request(body)


def vllm_client_errors() -> tuple[type[BaseException], ...]:
    """vLLM's exception for bad input (its validators raise it), or nothing when vLLM is
    not installed (the pure tests)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return ()
    return (VLLMClientError,)


@functools.cache
def engine_refusals() -> tuple[type[BaseException], ...]:
    """What vLLM's serving layer raises for an input it cannot take: a refusal, before any output."""
    return (KeyError, TypeError, ValueError, *vllm_client_errors())


class PromptError(ValueError):
    """vLLM refused to render a request's prompt (bad messages, template, tools ...)."""


class SamplingError(PromptError):
    """vLLM's checks of the sampling parameters refused them; `parameter` names the field."""

    def __init__(self, message: str, parameter: str | None) -> None:
        super().__init__(message)
        self.parameter = parameter


class PromptTooLong(PromptError):
    """The rendered prompt does not fit the context; `tokens` is a lower bound, if known."""

    def __init__(self, message: str, tokens: int | None) -> None:
        super().__init__(message)
        self.tokens = tokens


class Rendering(NamedTuple):
    """A request as vLLM's renderer left it (its tool parser may have adjusted it) and what
    the renderer returned: (conversation, engine inputs) for a chat, engine inputs for a
    completion."""

    request: Any
    result: Any

    @property
    def inputs(self) -> list:
        return self.result[1] if isinstance(self.result, tuple) else self.result

    @property
    def text_only(self) -> bool:
        """Token prompts only: an image the route processed never reached the engine's
        multimodal cache, which must see every item its engine core is sent."""
        return all(x.get("type") == "token" for x in self.inputs)


class PromptRenderer:
    """vLLM's own engine-less renderer, configured as the pool engines are, so the router counts exactly the
    prompt tokens an engine will see: the chat template with `tools`, `documents`, `chat_template_kwargs`,
    assistant `tool_calls`, every content part, truncation and special tokens, as vLLM renders them (Ray LLM's
    pre-routing tokenizer builds one alike, without the reasoning parser). Building it loads the tokenizer and
    model config (a fraction of a second); each count renders one deep copy of the request, and keeps the
    `Rendering` for an engine in the same process (`RayLLMEngine.generate`)."""

    def __init__(self, llm_config: Any) -> None:
        from vllm.entrypoints.chat_utils import load_chat_template
        from vllm.entrypoints.launchers.cli_args import FrontendArgs
        from vllm.renderers import renderer_from_config
        from vllm.renderers.online_renderer import OnlineRenderer

        from ray.llm._internal.serve.engines.vllm.vllm_engine import _get_vllm_engine_config

        _, vllm_config = _get_vllm_engine_config(llm_config, device_type="cpu")
        frontend = FrontendArgs(**llm_config.get_engine_config().frontend_kwargs)
        self._model_config = model = vllm_config.model_config
        self._sampling_defaults = self._model_config.get_diff_sampling_param()  # reads generation_config.json
        base = renderer_from_config(vllm_config)
        self._top_id = None if (tok := base.tokenizer) is None else max(tok.max_token_id, model.get_vocab_size() - 1)
        self._renderer = OnlineRenderer(
            self._model_config, base, request_logger=None,
            chat_template=load_chat_template(frontend.chat_template),
            chat_template_content_format=frontend.chat_template_content_format,
            trust_request_chat_template=frontend.trust_request_chat_template,
            enable_auto_tools=frontend.enable_auto_tool_choice,
            exclude_tools_when_tool_choice_none=frontend.exclude_tools_when_tool_choice_none,
            tool_parser=frontend.tool_call_parser,
            reasoning_parser=vllm_config.structured_outputs_config.reasoning_parser,
            default_chat_template_kwargs=frontend.default_chat_template_kwargs,
        )

    async def count(self, kind: str, body: Any) -> Any:
        """A `CountedPrompt` of a validated chat or completion request, with its
        `Rendering`; PromptError when vLLM would refuse it."""
        import jinja2
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.renderers.inputs.preprocess import extract_prompt_len

        request = body.model_copy(deep=True)  # rendering mutates the request
        self._check_sampling(kind, request)
        try:
            if kind == "chat":
                result = await self._renderer.render_chat(request, skip_mm_cache=True)
                inputs = result if isinstance(result, ErrorResponse) else result[1]
            else:
                result = inputs = await self._renderer.render_completion(request, skip_mm_cache=True)
        except (ValueError, TypeError, KeyError, jinja2.TemplateError, *vllm_client_errors()) as e:
            if getattr(e, "parameter", None) == "input_tokens":  # vLLM's own context-length check
                raise PromptTooLong(str(e), getattr(e, "value", None)) from None
            if getattr(e, "parameter", None) == "input_text":  # the same, judged from characters
                raise PromptTooLong(str(e), None) from None
            raise PromptError(f"{type(e).__name__}: {e}") from None
        if isinstance(inputs, ErrorResponse):
            raise PromptError(inputs.error.message)
        for ids in filter(None, (x.get("prompt_token_ids") for x in inputs if self._top_id is not None)):
            if (bad := min(ids)) < 0 or (bad := max(ids)) > self._top_id:  # vLLM checks once a gate admitted it
                raise PromptError(f"Token id {bad} is out of vocabulary (0 to {self._top_id})")
        return CountedPrompt(sum(extract_prompt_len(self._model_config, x) for x in inputs), Rendering(request, result))

    def _check_sampling(self, kind: str, request: Any) -> None:
        """vLLM's own checks of the sampling parameters against the model (logprobs above its
        max_logprobs, stop or logit-bias token ids outside the vocabulary, min_tokens above
        max_tokens...), as its serving layer makes them: the engine would refuse such a request
        only once a gate had admitted it, after it had waited in the queue."""
        asked, _ = asked_tokens(kind, request)
        ids, most = getattr(request, "logprob_token_ids", None) or (), self._model_config.max_logprobs
        if most >= 0 and len(ids) > most:  # vLLM bounds top_logprobs so, not these (each costs a decode a token)
            raise SamplingError(f"Requested {len(ids)} logprob_token_ids, max allowed: {most}", "logprob_token_ids")
        try:
            params = request.to_sampling_params(asked or self._model_config.max_model_len, self._sampling_defaults)
            params.verify(self._model_config, None, None, None)
        except (ValueError, TypeError, *vllm_client_errors()) as e:
            param = getattr(e, "parameter", None)
            raise SamplingError(str(e), "top_logprobs" if kind == "chat" and param == "logprobs" else param) from None


def asked_tokens(kind: str, body: Any) -> tuple[int | None, str]:
    """The output tokens a request asks for, and the field it asked with: on chat,
    max_completion_tokens wins over the deprecated max_tokens, as in vLLM."""
    if kind == "chat" and body.max_completion_tokens is not None:
        return body.max_completion_tokens, "max_completion_tokens"
    return body.max_tokens, "max_tokens"


class RayLLMEngine:
    """`pools.engine.Engine` on ray.serve.llm's VLLMEngine, with a stat logger that keeps vLLM's scheduler
    figures (running, waiting, KV usage, preemptions, generated tokens, engine-side latencies) in a `StatsBox`,
    and streams batched every `stream_batching_ms` after the first item."""

    START_TIMEOUT_S = 3600.0

    def __init__(self, llm_config: Any, stream_batching_ms: float) -> None:
        from pools.engine import StatsBox

        self._llm_config = llm_config
        self._interval_s = stream_batching_ms / 1e3
        self.stats_box = StatsBox()
        self._engine: Any = None
        self._vllm_config: Any = None
        self._handover: _Handover | None = None

    async def start(self) -> None:
        from pools.engine import drop_engine_overrides
        from pools.streams import mark_output

        if dropped := drop_engine_overrides():
            log.warning("ignoring %s from the environment: the pool's engine settings size the engine", dropped)
        self._engine = _stat_logging_engine_cls(self)(self._llm_config)
        if not needs_node_download(self._llm_config):
            self._llm_config.get_or_create_callback().ctx.run_init_node = False
        await within(self.START_TIMEOUT_S, self._engine.start())
        mark_output(client := self._engine._engine_client)
        if any(getattr(s, "engine_client", client) is not client
               for s in (self._engine._oai_serving_chat, self._engine._oai_serving_completion)):
            log.warning("the engine's serving layers generate through another client: a whole answer that fails "
                        "after its generation reads as the input's refusal, and its charge is refunded")
        if (handover := _Handover.install(self._engine)) is None:
            log.warning("the engine's serving layers have no one renderer to stand in for: every prompt is "
                        "rendered twice, by the route and by the engine")
        self._handover = handover

    def facts(self):
        import vllm

        from pools.engine import EngineFacts, hardware_name, setup_name

        if self._vllm_config is None:
            return None
        c = self._vllm_config
        cache, model = c.cache_config, c.model_config
        sizes = c.compilation_config.cudagraph_capture_sizes or []
        return EngineFacts(vllm_version=vllm.__version__, hardware=hardware_name(),
                           kv_capacity_tokens=(cache.num_gpu_blocks or 0) * cache.block_size,
                           block_size=cache.block_size, cudagraph_capture_sizes=tuple(sorted(sizes)),
                           setup=setup_name(model.hf_config, cache.block_size, model.enforce_eager,
                                            c.scheduler_config.enable_chunked_prefill))

    def generate(self, call: Any):
        """The engine's stream for a call; a call the route rendered in this process runs the request its
        renderer left, and the engine's serving layer takes the rendering instead of rendering the prompt a
        second time."""
        from pools.streams import batched, whole_answer

        rendering = call.rendered
        if rendering is not None and not (self._handover is not None and rendering.text_only):
            rendering = None  # the engine renders the request as the client sent it
        body = (call.body if rendering is None else rendering.request).model_copy(
            update={"priority": int(call.priority)})  # vLLM runs lower values first
        if rendering is None:
            stream = getattr(self._engine, call.kind)(body, None)
        else:
            stream = self._handed(call.kind, body, rendering.result)
        if getattr(body, "stream", False):
            return batched(stream, self._interval_s)
        return whole_answer(stream, engine_refusals())

    async def _handed(self, kind: str, body: Any, result: Any):
        with self._handover.holding(body, result):
            async for item in getattr(self._engine, kind)(body, None):
                yield item

    async def warm_up(self, requests: int) -> None:
        """Short requests of growing batch sizes: the first ones after a start compile kernels."""
        import asyncio

        _, completion_cls = request_models()

        async def one(i: int) -> None:
            async for _ in self._engine.completions(
                    completion_cls(prompt="warm up " * (4 + 8 * i), max_tokens=8, ignore_eos=True), None):
                pass

        size = 1
        while size <= requests:
            await asyncio.gather(*(one(i) for i in range(size)))
            size *= 2
        self.stats_box.clear_latency()

    async def check_health(self) -> None:
        await self._engine.check_health()

    async def shutdown(self) -> None:
        """Ray LLM's own shutdown only closes a token channel; vLLM's engine processes stop with the AsyncLLM's
        (they would otherwise outlive a replica stopped gracefully until the reaper saw it go)."""
        if self._engine is not None:
            await self._engine.shutdown()
            if (client := getattr(self._engine, "_engine_client", None)) is not None:
                client.shutdown()


class _Handover:
    """Stands in for the engine's serving-layer renderer (vLLM's `OnlineRenderer`): a request held here, matched
    by identity, gets back what the route's renderer made of it, once; every other request is rendered as
    before. The serving layer's own checks (model, preflight) still run; only the template and the tokenizer's
    second pass are saved. The inputs arrive when they are handed over: vLLM stamps an input's arrival when it
    renders it, and the engine measures TTFT from that stamp (the autoscaler's engine TTFT, which must not hold
    the gate's queue) and orders a priority class by it."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._held: dict[int, tuple[Any, Any]] = {}

    @classmethod
    def install(cls, engine: Any) -> "_Handover | None":
        servings = [s for s in (engine._oai_serving_chat, engine._oai_serving_completion) if s is not None]
        inners = {id(s.online_renderer): s.online_renderer for s in servings}
        if len(inners) != 1:  # vLLM's app state shares one renderer; anything else renders as it did
            return None
        handover = cls(next(iter(inners.values())))
        for serving in servings:
            serving.online_renderer = handover
        return handover

    def __getattr__(self, name: str) -> Any:
        if name == "_inner":  # not set yet (a copy): no endless lookup
            raise AttributeError(name)
        return getattr(self._inner, name)

    @contextlib.contextmanager
    def holding(self, request: Any, result: Any):
        self._held[id(request)] = (request, result)
        try:
            yield
        finally:
            self._held.pop(id(request), None)

    def _take(self, request: Any) -> Any:
        held = self._held.get(id(request))
        if held is None or held[0] is not request:
            return None
        del self._held[id(request)]
        now, result = time.time(), held[1]
        if isinstance(result, tuple):
            return result[0], [{**x, "arrival_time": now} for x in result[1]]
        return [{**x, "arrival_time": now} for x in result]

    async def render_chat(self, request: Any, **kwargs: Any) -> Any:
        if (result := self._take(request)) is not None:
            return result
        return await self._inner.render_chat(request, **kwargs)

    async def render_completion(self, request: Any, **kwargs: Any) -> Any:
        if (result := self._take(request)) is not None:
            return result
        return await self._inner.render_completion(request, **kwargs)


def needs_node_download(llm_config: Any) -> bool:
    """Whether Ray LLM's node initialisation has work to do before an engine starts. It runs a task on the
    engine's node that copies the model from cloud storage (s3://, gs://, a mirror); for a directory or a hub id
    (which vLLM fetches itself) the task only returns the source, yet starts a Ray worker that imports torch
    first: seconds of every replica start."""
    from ray.llm._internal.common.utils.cloud_utils import is_remote_path

    engine_config = llm_config.get_engine_config()
    return engine_config.mirror_config is not None or is_remote_path(engine_config.actual_hf_model_id)


def _stat_logging_engine_cls(owner: RayLLMEngine):
    """VLLMEngine whose AsyncLLM gets one more stat logger, writing into `owner.stats_box`."""
    from ray.llm._internal.serve.engines.vllm.vllm_engine import VLLMEngine

    class StatLoggingEngine(VLLMEngine):
        def _start_async_llm_engine(self, vllm_engine_args, vllm_engine_config, placement_group):
            client = super()._start_async_llm_engine(vllm_engine_args, vllm_engine_config, placement_group)
            owner._vllm_config = vllm_engine_config
            if client.logger_manager is not None:
                client.logger_manager.stat_loggers.append(_recorder_cls(owner.stats_box)(None, [0]))
            return client

    return StatLoggingEngine


def _recorder_cls(box: Any):
    from vllm.v1.metrics.loggers import AggregateStatLoggerBase

    class _Recorder(AggregateStatLoggerBase):
        def __init__(self, vllm_config, engine_indexes):  # noqa: D401 - vLLM's signature
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                box.running = scheduler_stats.num_running_reqs
                box.waiting = scheduler_stats.num_waiting_reqs
                box.kv_usage = scheduler_stats.kv_cache_usage
            if iteration_stats is not None:
                box.preemptions += iteration_stats.num_preempted_reqs
                box.generated_tokens += iteration_stats.num_generation_tokens
                box.add_ttft(iteration_stats.time_to_first_tokens_iter)
                box.add_tpot(r.mean_time_per_output_token for r in iteration_stats.finished_requests)

        def log_engine_initialized(self):
            pass

    return _Recorder


def deployment_options(llm_config: Any) -> dict[str, Any]:
    """The Serve options ray.serve.llm gives an LLM server deployment: its placement group
    (the engine's bundles merged with the replica's) and runtime env, with Ray LLM's defaults."""
    from ray.llm._internal.common.dict_utils import maybe_apply_llm_deployment_config_defaults
    from ray.llm._internal.serve.core.server.builder import DEFAULT_DEPLOYMENT_OPTIONS
    from ray.serve.llm import LLMServer

    return maybe_apply_llm_deployment_config_defaults(DEFAULT_DEPLOYMENT_OPTIONS,
                                                      LLMServer.get_deployment_options(llm_config))
