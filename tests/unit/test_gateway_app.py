"""The gateway app in process (no fleet behind it): what is refused before a request reaches the router."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from cascadia.gateway.app import GatewayConfig, create_app
from cascadia.gateway.auth import KeyRing
from cascadia.gateway.router_client import RouterClient
from cascadia.gateway.schemas import ChatCompletionRequest, CompletionRequest
from cascadia.gateway.text import TextCodec
from cascadia.router.local import free_port


@pytest.fixture
def call(tiny):
    # nothing listens on the router's port: anything that got past the gateway's checks would be a 503
    config = GatewayConfig("tiny", 500, max_context=64, max_body_bytes=4096)
    app = create_app(config, RouterClient(f"127.0.0.1:{free_port()}"), TextCodec.from_directory(tiny), KeyRing(["k"]))

    def run(method: str, path: str, headers: dict | None = None, **kwargs) -> httpx.Response:
        async def go():
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                sent = {"Authorization": "Bearer k", **(headers or {})}
                return await client.request(method, path, headers=sent, **kwargs)

        return asyncio.run(go())

    return run


def test_a_body_over_the_limit_is_refused_before_parsing(call):
    big = {"model": "tiny", "prompt": "x" * 5000}
    response = call("POST", "/v1/completions", json=big)
    assert response.status_code == 413 and "max_body_bytes" in response.json()["error"]["message"]

    async def chunks():
        yield b'{"model": "tiny", "prompt": "'
        yield b"y" * 5000
        yield b'"}'

    response = call("POST", "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413


def test_a_valid_request_reaches_the_router_and_its_absence_is_a_503(call):
    response = call("POST", "/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2})
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "unavailable"


def test_unknown_routes_and_methods_get_openai_shaped_errors(call):
    assert call("GET", "/v1/nothing").json()["error"]["message"] == "Not Found"
    response = call("GET", "/v1/completions")
    assert response.status_code == 405 and "POST" in response.headers["allow"]


def test_per_key_limits_apply_to_keys_not_to_the_callers_of_an_open_gateway(tiny):
    codec = TextCodec.from_directory(tiny)
    config = GatewayConfig("tiny", 500, max_concurrent_per_key=2)
    router = RouterClient(f"127.0.0.1:{free_port()}")
    assert create_app(config, router, codec, KeyRing(["k"])).state.gateway.limiter.limit == 2
    assert create_app(config, router, codec, KeyRing([])).state.gateway.limiter.limit == 0


def test_the_openapi_schema_names_the_model_and_bounds_token_ids(call):
    schema = call("GET", "/openapi.json").json()
    request = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["model"]["enum"] == ["tiny"]
    assert '"maximum": 499' in str(request["prompt"]).replace("'", '"')


def test_a_chat_part_a_text_model_cannot_read_is_refused_by_name(call):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}
    question = {"type": "text", "text": "What is it?"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": [question, image]}]}
    response = call("POST", "/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "messages[0].content[1]" and "'image_url'" in error["message"]
    body["messages"][0]["content"] = [question]
    assert call("POST", "/v1/chat/completions", json=body).status_code == 503  # text alone reaches the router


def test_every_response_carries_its_own_request_id(call):
    """As OpenAI's API: refusals before any route (413), unknown routes, errors and answers alike."""
    seen = [
        call("GET", "/v1/nothing"),
        call("POST", "/v1/completions", json={"model": "tiny", "prompt": "x" * 5000}),
        call("POST", "/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 2}),
        call("GET", "/v1/models"),
    ]
    ids = [response.headers.get("x-request-id", "") for response in seen]
    assert all(re.fullmatch(r"req_[0-9a-f]{32}", i) for i in ids), ids
    assert len(set(ids)) == len(ids)


def test_a_prompt_that_leaves_the_context_no_room_is_context_length_exceeded(call):
    """OpenAI's code for it, naming the prompt; a prompt that fits is bounded by max_tokens instead."""
    response = call("POST", "/v1/completions", json={"model": "tiny", "prompt": [5] * 64, "max_tokens": 1})
    error = response.json()["error"]
    assert response.status_code == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    response = call("POST", "/v1/completions", json={"model": "tiny", "prompt": [5] * 60, "max_tokens": 8})
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"


HARMLESS = {
    "metadata": {"team": "search"},
    "store": False,
    "safety_identifier": "user-1234",
    "prompt_cache_key": "tenant-7",
    "service_tier": "auto",
}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_fields_the_spec_gives_both_apis_pass_and_what_cannot_be_honoured_is_refused_by_name(call, path):
    """One policy for chat and completions, as /v1/responses takes the same fields: accepted (the request
    reaches the router, absent here: 503), or a 400 naming the field and why."""
    body = {"model": "tiny", "max_tokens": 2}
    body |= {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": [5, 6]}
    extra = {"modalities": ["text"]} if "chat" in path else {"best_of": 1, "suffix": ""}
    assert call("POST", path, json=body | HARMLESS | extra).status_code == 503
    streamed = body | {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}
    request = (ChatCompletionRequest if "chat" in path else CompletionRequest).model_validate(streamed)
    assert request.stream_options is not None and request.stream_options.include_usage
    refused = {"store": True, "service_tier": "premium"}
    refused |= {"modalities": ["text", "audio"]} if "chat" in path else {"best_of": 3, "suffix": "end."}
    for name, value in refused.items():
        response = call("POST", path, json=body | {name: value})
        assert response.status_code == 400, (name, response.text)
        assert response.json()["error"]["param"].startswith(name), response.json()


def test_responses_take_the_same_fields_and_their_own():
    from cascadia.gateway.responses_schemas import ResponseRequest

    request = ResponseRequest.model_validate(
        {"model": "tiny", "input": "hi", **HARMLESS, "store": True, "text": {"verbosity": "low"}}
    )
    assert request.service_tier == "auto" and request.text is not None and request.text.verbosity == "low"
    with pytest.raises(ValueError, match="service_tier"):
        ResponseRequest.model_validate({"model": "tiny", "input": "hi", "service_tier": "premium"})
