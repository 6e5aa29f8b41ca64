"""The Responses API over the chat path: input items to chat messages, answers to output items and events.

A response's input (and the stored conversation it continues) becomes a chat request, checked and
rendered as `/v1/chat/completions` renders one, so both endpoints give the same tokens for the same
conversation, and a next turn takes over the last one's state on the stages alike. `OutputBuilder`
turns the answer, streamed or whole, into the output items and the events that announce them.
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from cascadia.gateway.errors import ApiError, bad_request
from cascadia.gateway.generation import TokenLogprob
from cascadia.gateway.logprobs import chat_logprobs
from cascadia.gateway.responses_schemas import (
    FunctionToolChoice,
    InputItem,
    InputItemList,
    MessageItem,
    ResponseRequest,
    TextFormatJsonObject,
    TextFormatJsonSchema,
)
from cascadia.gateway.schemas import ChatCompletionRequest, Unsupported

# chat parameter -> the Responses parameter a client gave it as
RESPONSE_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def refuse_unsupported_items(items: Sequence[InputItem], param: str) -> None:
    """A 400 naming the first of `items` (the request's `param`), or part of one, of a kind a text model
    does not serve."""
    for i, item in enumerate(items):
        if isinstance(item, Unsupported):
            raise bad_request(
                f"Input items of type '{item.type}' are not supported: give messages, function_call and "
                "function_call_output items.",
                f"{param}[{i}]",
            )
        content = item.content if isinstance(item, MessageItem) else getattr(item, "output", "")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, Unsupported):
                raise bad_request(
                    f"Content parts of type '{part.type}' are not supported: this model reads text.",
                    f"{param}[{i}].content[{j}]",
                )


def refuse_unsupported(body: ResponseRequest) -> None:
    """A 400 naming the first item, part or tool of a kind a text model does not serve."""
    refuse_unsupported_items(body.input if isinstance(body.input, list) else [], "input")
    if body.conversation is not None and body.previous_response_id is not None:
        raise bad_request("Give 'conversation' or 'previous_response_id', not both.", "conversation")
    for i, tool in enumerate(body.tools or ()):
        if isinstance(tool, Unsupported):
            raise bad_request(f"Tools of type '{tool.type}' are not supported: give function tools.", f"tools[{i}]")
    if body.reasoning:
        raise bad_request("This model does not reason: leave 'reasoning' out.", "reasoning")


def input_items(body: ResponseRequest) -> list[dict[str, Any]]:
    """The request's input as the items OpenAI lists: text is one user message, a message's text a part of
    its content, and every item has an id."""
    given = body.input if body.input is not None else []
    return listed_items([{"type": "message", "role": "user", "content": given}] if isinstance(given, str) else given)


def listed_items(items: Sequence[InputItem | dict[str, Any]]) -> list[dict[str, Any]]:
    return [_listed(item if isinstance(item, dict) else item.model_dump(exclude_none=True)) for item in items]


def page_of(items: list[dict[str, Any]], limit: int, order: str, after: str | None) -> InputItemList:
    """One page of a list of items, newest first for order "desc", from the one after the item `after`."""
    ordered = list(reversed(items)) if order == "desc" else list(items)
    if after is not None:
        ids = [item["id"] for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    page = ordered[:limit]
    return InputItemList(
        data=page,
        first_id=page[0]["id"] if page else None,
        last_id=page[-1]["id"] if page else None,
        has_more=len(ordered) > limit,
    )


def _listed(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    prefix = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}[kind]
    out = {"id": item_id(prefix), **item, "type": kind}
    if kind == "message" and isinstance(item["content"], str):
        part = "output_text" if item["role"] == "assistant" else "input_text"
        out["content"] = [{"type": part, "text": item["content"]}]
    if kind == "message":
        out.setdefault("status", "completed")
    return out


def _text(content: str | list[dict[str, Any]]) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or part.get("refusal") or "" for part in content)


def chat_messages(instructions: str | None, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages for `items`: calls join the assistant message before them, outputs become tool messages."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            messages.append({"role": item["role"], "content": _text(item["content"])})
        elif kind == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
    return messages


def _response_format(body: ResponseRequest) -> dict[str, Any] | None:
    shape = body.text.format if body.text is not None else None
    if isinstance(shape, TextFormatJsonObject):
        return {"type": "json_object"}
    if isinstance(shape, TextFormatJsonSchema):
        given = shape.model_dump(by_alias=True, exclude_none=True, exclude={"type"})
        return {"type": "json_schema", "json_schema": given}
    return None


def chat_request(body: ResponseRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that generates this response's answer to `items` (400 naming what is wrong)."""
    choice = body.tool_choice
    if isinstance(choice, FunctionToolChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    tools = [
        {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
        for tool in body.tools or ()
    ]
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": chat_messages(body.instructions, items),
        "max_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "seed": body.seed,
        "logprobs": body.wants_logprobs,
        "top_logprobs": body.top_logprobs,
        "tools": tools or None,
        "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        "user": body.user,
    }
    if not fields["messages"]:
        raise bad_request("The response has no input: give 'input' (or 'instructions').", "input")
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise bad_request(f"Invalid input: {first['msg']}", "input") from None


def turn_starts(items: list[dict[str, Any]]) -> list[int]:
    """Where the conversation could start if its oldest turns were left out: 0, then each later user
    message (so a function's output never loses the call it answers)."""
    later = [
        i for i, item in enumerate(items) if i and item.get("type", "message") == "message" and item["role"] == "user"
    ]
    return [0, *later]


def as_response_error(exc: ApiError) -> ApiError:
    """A chat request's error named in the Responses API's terms."""
    param = RESPONSE_PARAMS.get(exc.param or "", exc.param)
    message = exc.message.replace("response_format", "text.format")
    return ApiError(exc.status, message, exc.type, param, exc.code)


def _logprobs(tokens: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [t.model_dump() for t in chat_logprobs(tokens).content or ()]


@dataclass
class OutputBuilder:
    """A response's output items as its answer arrives, and the stream events that announce them.

    Prose becomes a message item, opened at its first text that is not only whitespace (so a call after
    a blank line is not announced as a message); each whole call a function_call item, in the order the
    model wrote them (text after calls is a call cut short, kept as the model wrote it). An answer with
    neither is an empty message. Every method returns the events it caused, numbered in order; a whole
    answer fed at once gives the same items as one streamed.
    """

    wants_logprobs: bool = False
    output: list[dict[str, Any]] = field(default_factory=list)
    sequence: int = 0
    _message: dict[str, Any] | None = None  # the message item while its text is still arriving
    _blank: str = ""  # whitespace not yet known to open a message
    _pending: list[dict[str, Any]] = field(default_factory=list)  # log-probs of text not yet sent
    _calls: int = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def feed(self, parts: list[str | dict[str, Any]], tokens: list[TokenLogprob]) -> list[dict[str, Any]]:
        """Prose and whole calls in order, as the answer's reader settled them, and the tokens they came from."""
        if self.wants_logprobs and not self._calls:  # the text's tokens; a call's are in its arguments
            self._pending += _logprobs(tokens)
        events: list[dict[str, Any]] = []
        for part in parts:
            events += self._prose(part) if isinstance(part, str) else self._call(part)
        return events

    def finish(self, finish_reason: str | None) -> list[dict[str, Any]]:
        """The answer ended: an empty message for an answer with nothing else, and the last message closed."""
        events: list[dict[str, Any]] = []
        if not self.output:
            events += self._open_message()
            if self._blank:
                events.append(self._text_delta(self._blank))
                self._blank = ""
        return events + self._close_message("incomplete" if finish_reason == "length" else "completed")

    def _prose(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self._message is not None:
            return [self._text_delta(text)]
        self._blank += text
        if not self._blank.strip():
            return []
        text, self._blank = self._blank, ""
        return [*self._open_message(), self._text_delta(text)]

    def _open_message(self) -> list[dict[str, Any]]:
        message = {"id": item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        self._message = message
        self.output.append(message)
        index = len(self.output) - 1
        added = self.event("response.output_item.added", output_index=index, item=_copy(message))
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        message["content"].append(part)
        ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [added, self.event("response.content_part.added", **ids, part=_copy(part))]

    def _text_delta(self, text: str) -> dict[str, Any]:
        assert self._message is not None
        part = self._message["content"][0]
        part["text"] += text
        logprobs, self._pending = self._pending, []
        part["logprobs"] += logprobs
        ids = {"item_id": self._message["id"], "output_index": len(self.output) - 1, "content_index": 0}
        return self.event("response.output_text.delta", **ids, delta=text, logprobs=logprobs)

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        self._message = None
        part = message["content"][0]
        part["logprobs"] += self._pending
        self._pending = []
        message["status"] = status
        index = self.output.index(message)
        ids = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **ids, text=part["text"], logprobs=list(part["logprobs"])),
            self.event("response.content_part.done", **ids, part=_copy(part)),
            self.event("response.output_item.done", output_index=index, item=_copy(message)),
        ]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._close_message("completed")
        self._blank = ""
        function = call["function"]
        item = {
            "id": item_id("fc"),
            "type": "function_call",
            "call_id": call["id"],
            "name": function["name"],
            "arguments": "",
            "status": "in_progress",
        }
        self.output.append(item)
        self._calls += 1
        index, arguments = len(self.output) - 1, function["arguments"]
        ids = {"item_id": item["id"], "output_index": index}
        events.append(self.event("response.output_item.added", output_index=index, item=_copy(item)))
        events.append(self.event("response.function_call_arguments.delta", **ids, delta=arguments))
        item.update(arguments=arguments, status="completed")
        events.append(
            self.event("response.function_call_arguments.done", **ids, arguments=arguments, name=item["name"])
        )
        events.append(self.event("response.output_item.done", output_index=index, item=_copy(item)))
        return events


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """An item as it stands now (an event carries a snapshot, not the item that goes on growing)."""
    return copy.deepcopy(item)


def status_of(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A finished answer's response status and incomplete details."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None
