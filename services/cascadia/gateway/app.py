"""The FastAPI app: OpenAI completions, chat completions and responses (JSON or SSE), models, health, metrics."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cascadia.gateway.auth import ConcurrencyLimiter, Key, KeyRing
from cascadia.gateway.choices import Choices, choice_params
from cascadia.gateway.conversations_routes import add_conversation_routes
from cascadia.gateway.errors import ApiError, bad_request, error_body
from cascadia.gateway.generation import Delta, Generation, TokenLogprob
from cascadia.gateway.logprobs import chat_logprobs, completion_logprobs
from cascadia.gateway.metrics import GatewayMetrics
from cascadia.gateway.response_store import MemoryStore, ResponseStore
from cascadia.gateway.responses_routes import add_response_routes
from cascadia.gateway.router_client import RouterClient
from cascadia.gateway.schemas import (
    MAX_CHOICES,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    SamplingFields,
    StreamOptions,
    Unsupported,
    error_responses,
)
from cascadia.gateway.text import TemplateFailed, TextCodec
from cascadia.gateway.tools import (
    CALL_CLOSE,
    CALL_OPEN,
    AnswerReader,
    ToolAnswer,
    answer_message,
    markup_grammar,
    tool_calls_schema,
)
from cascadia.gateway.watch import run_watched, watched_stream
from cascadia.grammar import (
    GrammarError,
    GrammarVocabulary,
    cfg_grammar,
    check_grammar,
    choice_grammar,
    json_grammar,
    regex_grammar,
)
from cascadia.sampling_params import SamplingParams

log = logging.getLogger("cascadia.gateway")


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    vocab_size: int  # ids at or above it are rejected before they reach a shard
    max_context: int = 1024  # positions a stream may use: prompt plus generated tokens
    max_prompt_tokens: int = 0  # 0: max_context - 1
    max_concurrent_per_key: int = 64  # 0: no limit
    max_body_bytes: int = 8 << 20  # a full context of token ids fits with room to spare

    @property
    def prompt_limit(self) -> int:
        return self.max_prompt_tokens or self.max_context - 1


class BodyLimit:
    """Refuse a body over `limit` bytes with 413 before anything parses it (declared or chunked)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def _refuse(self, send: Send) -> None:
        error = ApiError(
            413, f"The request body is over the limit (max_body_bytes) of {self.limit} bytes.", code="request_too_large"
        )
        await error.response()({"type": "http"}, None, send)  # type: ignore[arg-type]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await self._refuse(send)
            return
        if declared is not None:
            await self.app(scope, receive, send)
            return
        # no length given (chunked): read up to the limit, then hand the app what was read
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse(send)
                return
            if not message.get("more_body"):
                break
        replay = iter(messages)

        async def buffered() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, buffered, send)


class RequestCounter:
    """Counts responses by route and status (a plain ASGI middleware, so streams pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                route = scope.get("route")
                self.metrics.requests.labels(getattr(route, "path", "unmatched"), str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class RequestIds:
    """Gives every response an `x-request-id`, as OpenAI's API does: clients log it, and the openai client
    shows it as a response's `_request_id` (a plain ASGI middleware, so streams pass through untouched)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header = (b"x-request-id", f"req_{uuid.uuid4().hex}".encode())

        async def identified_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        await self.app(scope, receive, identified_send)


def _param_name(location: tuple) -> str | None:
    parts = [str(p) for p in location if p != "body"]
    return ".".join(parts) or None


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's messages and tools as the template takes them, and the prompt they render to."""

    ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    tools_answer: ToolAnswer | None


@dataclass(frozen=True)
class RenderedChat:
    """A chat request checked and rendered: its prompt and sampling, no generation made yet."""

    ids: list[int]
    params: SamplingParams
    shared_prefix: int  # the prompt's tokens other requests are likely to start with
    tools: ToolAnswer | None


@dataclass(frozen=True)
class PreparedChat:
    """A chat request checked and turned into its generations, not yet started."""

    choices: Choices
    tools: ToolAnswer | None


@dataclass
class Gateway:
    config: GatewayConfig
    router: RouterClient
    codec: TextCodec
    keys: KeyRing
    metrics: GatewayMetrics
    limiter: ConcurrencyLimiter
    vocabulary: GrammarVocabulary | None = None  # the model's tokens, to check a response_format's grammar against

    def check_model(self, name: str) -> None:
        if name != self.config.model_name:
            raise ApiError(
                404,
                f"The model '{name}' does not exist; this gateway serves '{self.config.model_name}'.",
                param="model",
                code="model_not_found",
            )

    def check_prompt(self, ids: list[int], max_tokens: int | None, param: str) -> int:
        """The number of tokens to generate, after the prompt and context limits (400)."""
        cfg = self.config
        bad = [t for t in ids if t >= cfg.vocab_size]
        if bad:
            raise bad_request(f"Token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size}).", param)
        if len(ids) >= cfg.max_context:  # the prompt alone leaves no room: OpenAI's code for that
            raise ApiError(
                400,
                f"This model's context (max_context) is {cfg.max_context} tokens; the prompt alone has {len(ids)}.",
                param=param,
                code="context_length_exceeded",
            )
        if len(ids) > cfg.prompt_limit:  # this gateway's own bound on prompts (max_prompt_tokens)
            raise bad_request(
                f"The prompt has {len(ids)} tokens; the limit (max_prompt_tokens) is {cfg.prompt_limit}.",
                param,
                "prompt_too_long",
            )
        room = cfg.max_context - len(ids)
        wanted = room if max_tokens is None else max_tokens
        if wanted > room or room < 1:
            raise ApiError(
                400,
                f"This model's context (max_context) is {cfg.max_context} tokens; the prompt has {len(ids)} and "
                f"{wanted} more were asked for.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return wanted

    def logit_bias(self, body: SamplingFields) -> tuple[tuple[int, float], ...]:
        """The request's logit_bias as (token, bias) pairs, its keys checked against the vocabulary (400)."""
        biases: dict[int, float] = {}
        for key, bias in (body.logit_bias or {}).items():
            token = int(key) if key.isascii() and key.isdigit() else -1
            if not 0 <= token < self.config.vocab_size or token in biases:
                raise bad_request(
                    f"Invalid key '{key}' in 'logit_bias': keys are distinct token ids in "
                    f"[0, {self.config.vocab_size}).",
                    "logit_bias",
                )
            biases[token] = bias
        return tuple(sorted(biases.items()))

    def grammar(self, body: SamplingFields) -> str:
        """The grammar a response_format or structured_outputs holds the text to ("" for none), checked (400)."""
        shape, structured = body.response_format, body.structured_outputs
        shaped = shape is not None and shape.type != "text"
        if not shaped and structured is None:
            return ""
        param = "structured_outputs" if structured is not None else "response_format"
        if shaped and structured is not None:
            raise bad_request("Give response_format or structured_outputs, not both.", param)
        self.check_grammars_served(param)
        try:
            if structured is None:
                grammar = json_grammar(shape.json_schema.json_schema if shape.type == "json_schema" else None)
            elif structured.json_schema is not None:
                grammar = json_grammar(structured.json_schema)
            elif structured.regex is not None:
                grammar = regex_grammar(structured.regex)
            elif structured.choice is not None:
                grammar = choice_grammar(structured.choice)
            else:
                grammar = cfg_grammar(structured.grammar)
            check_grammar(grammar, self.vocabulary)
        except GrammarError as exc:
            raise bad_request(f"Invalid '{param}': {exc}", param) from None
        return grammar

    @functools.cached_property
    def special_call_tags(self) -> tuple[str, ...]:
        """The call tags the tokenizer holds as tokens of their own (a grammar names them rather than spells)."""
        vocabulary = self.vocabulary
        return tuple(t for t in (CALL_OPEN, CALL_CLOSE) if vocabulary is not None and vocabulary.is_special(t))

    def check_grammars_served(self, param: str) -> None:
        if self.vocabulary is None or not self.codec.stop_token_ids:
            raise bad_request(
                f"This model's tokenizer cannot be matched against a {param}"
                + ("." if self.vocabulary is None else ": it has no end-of-text token."),
                param,
            )

    def tool_grammar(self, body: ChatCompletionRequest) -> ToolAnswer | None:
        """The grammar of an answer that may or must call tools (None when the answer is free text),
        checked here (400)."""
        choice = body.tool_choice or ("auto" if body.tools else "none")
        if not body.tools:
            if choice != "none":
                raise bad_request("'tool_choice' needs 'tools'.", "tool_choice")
            return None
        if choice == "none":
            return None
        markup = self.codec.knows_call_markup
        if choice == "auto" and not markup:
            raise bad_request(
                f"tool_choice 'auto' reads calls in the {CALL_OPEN} markup, and this model's chat template writes "
                "calls another way; give 'required', a named function or 'none'.",
                "tool_choice",
            )
        tools = {t.function.name: t.function.parameters for t in body.tools}
        if len(tools) < len(body.tools):
            raise bad_request("Tool names must be distinct.", "tools")
        if (body.response_format is not None and body.response_format.type != "text") or body.structured_outputs:
            raise bad_request("Tool calls and a response_format cannot both shape the answer.", "tool_choice")
        if not isinstance(choice, str):
            if choice.function.name not in tools:
                named = choice.function.name
                raise bad_request(f"tool_choice names '{named}', which is not in 'tools'.", "tool_choice")
            tools = {choice.function.name: tools[choice.function.name]}
        self.check_grammars_served("tools")
        parallel = body.parallel_tool_calls is not False
        try:
            if markup:
                special = self.special_call_tags
                grammar = cfg_grammar(markup_grammar(tools, parallel, prose=choice == "auto", special=special))
            else:
                grammar = json_grammar(tool_calls_schema(tools, parallel))
            check_grammar(grammar, self.vocabulary)
        except GrammarError as exc:
            raise bad_request(f"Invalid 'tools': {exc}", "tools") from None
        return ToolAnswer(grammar, markup)

    def sampling(
        self, body: SamplingFields, max_tokens: int, logprobs: bool, top_logprobs: int, grammar: str
    ) -> SamplingParams:
        """`grammar`: from `grammar` or `tool_grammar`, built once for all of a request's prompts."""
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=body.top_k or 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            max_tokens=max_tokens,
            stop_ids=self.codec.stop_token_ids,
            presence_penalty=body.presence_penalty or 0.0,
            frequency_penalty=body.frequency_penalty or 0.0,
            top_logprobs=top_logprobs,
            logprobs=logprobs,
            logit_bias=self.logit_bias(body),
            grammar=grammar,
        )

    def choices(
        self,
        id_prefix: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        body: SamplingFields,
        score_prompt: bool = False,
        shared_prefix: int = 0,
    ) -> Choices:
        """`body.n` generations for each prompt (with its own sampling), each its own request on the router.

        `id_prefix` starts the response's id as OpenAI's do (`chatcmpl-`, `cmpl-`, `resp_`); `shared_prefix`:
        the first tokens of every prompt that other requests are likely to start with."""
        n = body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise bad_request(
                f"This request asks for {len(prompts) * n} choices ({len(prompts)} prompts, n={n}); the limit "
                f"is {MAX_CHOICES} a request.",
                "n",
            )
        response_id = f"{id_prefix}{uuid.uuid4().hex}"
        generations = []
        for prompt, prompt_params in zip(prompts, params, strict=True):
            for j in range(n):
                self.metrics.prompt_tokens.inc(len(prompt))  # each choice runs its own prefill
                request_id = response_id if len(prompts) * n == 1 else f"{response_id}-{len(generations)}"
                generations.append(
                    Generation(
                        self.router,
                        self.codec,
                        request_id,
                        prompt,
                        choice_params(prompt_params, j),
                        body.stop_strings,
                        self.metrics,
                        wants_logprobs=prompt_params.logprobs,
                        speculation=body.speculation is not False,
                        score_prompt=score_prompt,
                        shared_prefix=shared_prefix,
                    )
                )
        return Choices(response_id, prompts, generations)

    def prepare_chat(self, body: ChatCompletionRequest, id_prefix: str) -> PreparedChat:
        """A chat request checked (4xx for anything wrong) and rendered into its generations."""
        return self.start_chat(self.render_chat(body), body, id_prefix)

    def start_chat(self, rendered: RenderedChat, body: ChatCompletionRequest, id_prefix: str) -> PreparedChat:
        choices = self.choices(id_prefix, [rendered.ids], [rendered.params], body, shared_prefix=rendered.shared_prefix)
        return PreparedChat(choices, rendered.tools)

    def render_chat(self, body: ChatCompletionRequest) -> RenderedChat:
        """A chat request checked (4xx for anything wrong) and rendered; nothing counted or started."""
        prompt = self.chat_prompt(body)
        ids, messages, tools, tools_answer = prompt.ids, prompt.messages, prompt.tools, prompt.tools_answer
        max_tokens = self.check_prompt(ids, body.max_completion_tokens or body.max_tokens, "messages")
        top = body.top_logprobs or 0 if body.logprobs else 0
        grammar = tools_answer.grammar if tools_answer else self.grammar(body)
        params = self.sampling(body, max_tokens, bool(body.logprobs), top, grammar)
        shared = self.codec.instructions_length(messages, tools, ids)
        return RenderedChat(ids, params, shared, tools_answer)

    def chat_prompt(self, body: ChatCompletionRequest) -> ChatPrompt:
        """A chat request's prompt, before the context's limits are checked (4xx for anything else wrong)."""
        self.check_model(body.model)
        if body.top_logprobs and not body.logprobs:
            raise bad_request("'top_logprobs' needs 'logprobs' set to true.", "top_logprobs")
        for i, message in enumerate(body.messages):
            for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
                if isinstance(part, Unsupported):
                    raise bad_request(
                        f"Content parts of type '{part.type}' are not supported: this model reads text.",
                        f"messages[{i}].content[{j}]",
                    )
        tools_answer = self.tool_grammar(body)
        messages = [_template_message(m) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools or ()]
        try:
            ids = self.codec.encode_chat(messages, tools)
        except TemplateFailed as exc:
            raise bad_request(str(exc), "messages") from None
        if not ids:
            raise bad_request("The messages render to an empty prompt.", "messages")
        return ChatPrompt(ids, messages, tools, tools_answer)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


async def _chunks(
    choices: Choices, chunks: Callable[[int, Delta], dict | None], usage_chunk: Callable[[], dict] | None
) -> AsyncIterator[str]:
    async for index, delta in choices.deltas():
        chunk = chunks(index, delta)
        if chunk is not None:
            yield _sse(chunk)
    if usage_chunk is not None:
        yield _sse(usage_chunk())
    yield "data: [DONE]\n\n"


@dataclass(frozen=True)
class _Envelope:
    """The fields every streamed chunk of one response carries, and its closing usage chunk."""

    choices: Choices
    object: str
    created: int
    model: str
    options: StreamOptions | None

    @property
    def include_usage(self) -> bool:
        return self.options is not None and self.options.include_usage

    def chunk(self, choice: dict[str, Any] | None) -> dict[str, Any]:
        out = {
            "id": self.choices.response_id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
        }
        if self.include_usage:
            out["usage"] = None  # only the last chunk carries it
        return out

    def usage(self) -> dict[str, Any]:
        return self.chunk(None) | {"usage": self.choices.usage().model_dump()}


def _streaming_response(
    request: Request,
    choices: Choices,
    chunks: Callable[[int, Delta], dict | None],
    envelope: _Envelope,
    release: Callable[[], None],
    metrics: GatewayMetrics,
) -> Response:
    usage = envelope.usage if envelope.include_usage else None
    failed = lambda exc: [_sse(error_body(exc))]  # noqa: E731
    return watched_stream(request, choices, _chunks(choices, chunks, usage), failed, release, metrics)


def _template_message(message: ChatMessage) -> dict[str, Any]:
    """A request's message as chat templates take it (an assistant's calls and a tool's answer included)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:  # arguments as an object, which templates write out themselves (as HF's expect)
        out["tool_calls"] = [_template_call(call.model_dump()) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    with contextlib.suppress(ValueError):
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    return call


def _describe_limits(schema: dict[str, Any], config: GatewayConfig) -> None:
    """Put this gateway's model name and vocabulary into its OpenAPI schema.

    The context limit stays out: how many tokens may be generated depends on the prompt's length,
    and a request over it gets 400 naming max_context (code context_length_exceeded, as OpenAI's).
    """
    components = schema["components"]["schemas"]

    def bound_token_ids(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0:
                node["maximum"] = config.vocab_size - 1
            for value in node.values():
                bound_token_ids(value)
        elif isinstance(node, list):
            for value in node:
                bound_token_ids(value)

    for name in ("CompletionRequest", "ChatCompletionRequest", "ResponseRequest"):
        props = components[name]["properties"]
        props["model"]["enum"] = [config.model_name]
    bound_token_ids(components["CompletionRequest"]["properties"]["prompt"])


def _allowed_methods(app: FastAPI, path: str) -> list[str]:
    """Every method some route serves at `path` (one path may have a route per method)."""
    methods: set[str] = set()
    for route in app.routes:
        pattern, served = getattr(route, "path_regex", None), getattr(route, "methods", None)
        if pattern is not None and served and pattern.match(path):
            methods |= served
    return sorted(methods)


def _vocabulary(codec: TextCodec, config: GatewayConfig) -> GrammarVocabulary | None:
    try:
        return GrammarVocabulary(codec.tokenizer.to_str(), config.vocab_size)
    except Exception:  # only response_format needs it: the rest is served regardless
        log.warning("the tokenizer cannot be matched against grammars: response_format is refused", exc_info=True)
        return None


def create_app(
    config: GatewayConfig, router: RouterClient, codec: TextCodec, keys: KeyRing, store: ResponseStore | None = None
) -> FastAPI:
    """`store`: where `/v1/responses` keeps responses (default: the most recent ones in memory)."""
    responses_store = store or MemoryStore()
    metrics = GatewayMetrics()
    # an open gateway has no callers to tell apart: the router's queue bounds it instead
    per_key = 0 if keys.open else config.max_concurrent_per_key
    gateway = Gateway(config, router, codec, keys, metrics, ConcurrencyLimiter(per_key), _vocabulary(codec, config))

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if keys.open:
            log.warning("no API keys configured: the gateway is open to anyone who can reach it")
        yield
        await background.stop()  # before the router and the store go: each run stores that it failed
        await router.close()
        await responses_store.close()

    app = FastAPI(
        title="Cascadia", version="0.1.0", lifespan=lifespan, description="OpenAI-compatible API of a Cascadia fleet."
    )
    app.state.gateway = gateway

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.errors.labels(exc.code or exc.type).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        param = _param_name(tuple(first.get("loc", ())))
        if first.get("type") == "json_invalid":
            message, param = "The body is not valid JSON.", None
        elif first.get("type") == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        else:
            message = f"Invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
        return await api_error(request, bad_request(message, param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = await api_error(request, ApiError(exc.status_code, str(exc.detail)))
        response.headers.update(exc.headers or {})
        if exc.status_code == 405:  # Starlette names the first matching route's methods only
            response.headers["Allow"] = ", ".join(_allowed_methods(app, request.url.path))
        return response

    app.add_middleware(BodyLimit, limit=config.max_body_bytes)
    app.add_middleware(RequestCounter, metrics=metrics)
    app.add_middleware(RequestIds)  # outermost: refusals before the routes get an id too

    errors = error_responses(400, 401, 404, 413, 429, 503)
    both = {200: {"content": {"text/event-stream": {}}}}

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz", tags=["health"], responses={503: {"description": "The router or a stage is not ready."}})
    async def readyz() -> JSONResponse:
        readiness = await router.readiness()
        return JSONResponse(
            status_code=200 if readiness.ready else 503,
            content={"status": "ready" if readiness.ready else "not ready", "detail": readiness.detail},
        )

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        with contextlib.suppress(grpc.aio.AioRpcError):  # metrics are served while the router is down too
            stats = await router.stats(timeout=1.0)
            metrics.queue_depth.set(stats.queued_requests)
            metrics.active_streams.set(stats.active_streams)
            metrics.kept_streams.set(stats.kept_streams)
            metrics.shared_prefixes.set(stats.shared_prefixes)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(401))
    async def list_models(key: Key) -> ModelList:
        return ModelList(data=[ModelCard(id=config.model_name, created=0)])

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=error_responses(401, 404))
    async def retrieve_model(model: str, key: Key) -> ModelCard:
        gateway.check_model(model)
        return ModelCard(id=config.model_name, created=0)

    @app.post("/v1/completions", response_model=CompletionResponse, responses={**errors, **both})
    async def completions(body: CompletionRequest, request: Request, key: Key) -> Any:
        gateway.check_model(body.model)
        prompts = [codec.encode(p) if isinstance(p, str) else list(p) for p in body.prompts]
        top, wants_logprobs = body.logprobs or 0, body.logprobs is not None
        grammar = gateway.grammar(body)
        params = [
            gateway.sampling(body, gateway.check_prompt(ids, body.max_tokens, "prompt"), wants_logprobs, top, grammar)
            for ids in prompts
        ]
        choices = gateway.choices("cmpl-", prompts, params, body, score_prompt=bool(body.echo) and wants_logprobs)
        n = body.n or 1
        echoes = [p if isinstance(p, str) else codec.decode(p) for p in body.prompts] if body.echo else None

        def echoed(index: int, text: str, tokens: list[TokenLogprob]) -> tuple[str, list[TokenLogprob]]:
            """A choice's first text and tokens, after its prompt's when the request echoes it."""
            if echoes is None:
                return text, tokens
            g = choices.generations[index]
            prompt = [TokenLogprob(g.prompt[0], codec.token_text(g.prompt[0]), None, None), *g.prompt_logprobs]
            return echoes[index // n] + text, prompt + tokens

        created = int(time.time())
        gateway.limiter.acquire(key)
        if body.stream:
            offsets: dict[int, int] = {}

            def chunk(index: int, delta: Delta) -> dict | None:  # one per token, as OpenAI streams them
                text, tokens = delta.text, delta.tokens
                if index not in offsets:
                    text, tokens = echoed(index, text, tokens)
                    offsets[index] = 0
                logprobs = None
                if wants_logprobs:
                    logprobs = completion_logprobs(tokens, offsets[index], top > 0).model_dump()
                    offsets[index] += sum(len(t.text) for t in tokens)
                choice = {"index": index, "text": text, "logprobs": logprobs}
                return envelope.chunk(choice | {"finish_reason": delta.finish_reason})

            envelope = _Envelope(choices, "text_completion", created, config.model_name, body.stream_options)
            return _streaming_response(request, choices, chunk, envelope, lambda: gateway.limiter.release(key), metrics)
        await run_watched(request, choices, functools.partial(gateway.limiter.release, key))
        return CompletionResponse(
            id=choices.response_id,
            created=created,
            model=config.model_name,
            choices=[
                CompletionChoice(
                    index=index,
                    text=text,
                    logprobs=completion_logprobs(tokens, 0, top > 0) if wants_logprobs else None,
                    finish_reason=g.finish_reason,
                )
                for index, g in enumerate(choices.generations)
                for text, tokens in [echoed(index, g.text, g.logprobs)]
            ],
            usage=choices.usage(),
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses={**errors, **both})
    async def chat_completions(body: ChatCompletionRequest, request: Request, key: Key) -> Any:
        prepared = gateway.prepare_chat(body, "chatcmpl-")
        choices, tools_answer = prepared.choices, prepared.tools
        created = int(time.time())
        gateway.limiter.acquire(key)
        if body.stream:
            started: set[int] = set()
            readers: dict[int, AnswerReader] = {}  # each call is sent once it is whole

            def chunk(index: int, delta: Delta) -> dict | None:
                first = index not in started
                reader = readers.setdefault(index, AnswerReader(tools_answer))
                before = reader.calls
                text, whole, finish = reader.feed(delta.text, delta.finish_reason)
                calls = [{**call, "index": before + n} for n, call in enumerate(whole)]  # which call it is
                if not (first or text or calls or finish or delta.tokens):
                    return None
                content: dict[str, Any] = {}
                if first:
                    content["role"] = "assistant"
                if text or first:
                    content["content"] = text
                if calls:
                    content["tool_calls"] = calls
                started.add(index)
                logprobs = chat_logprobs(delta.tokens).model_dump() if body.logprobs else None
                choice = {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
                return envelope.chunk(choice)

            envelope = _Envelope(choices, "chat.completion.chunk", created, config.model_name, body.stream_options)
            return _streaming_response(request, choices, chunk, envelope, lambda: gateway.limiter.release(key), metrics)
        await run_watched(request, choices, functools.partial(gateway.limiter.release, key))
        return ChatCompletionResponse(
            id=choices.response_id,
            created=created,
            model=config.model_name,
            choices=[
                ChatChoice(
                    index=index,
                    message=AssistantMessage(**answer),
                    logprobs=chat_logprobs(g.logprobs) if body.logprobs else None,
                    finish_reason=finish,
                )
                for index, g in enumerate(choices.generations)
                for answer, finish in [answer_message(g.text, g.finish_reason, tools_answer)]
            ],
            usage=choices.usage(),
        )

    background = add_response_routes(app, gateway, responses_store)
    add_conversation_routes(app, responses_store)

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            _describe_limits(schema, config)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app
