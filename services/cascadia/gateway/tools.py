"""Tool calls held to a grammar.

A model that knows the markup `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` (its chat
template writes it, or the gateway told it through `tools_instructions`) calls in that markup:
`tool_choice` "auto" lets it write text or calls, "required" and a named function leave it only calls.
Each call's name and arguments are held to the tools' schemas, and `CallReader` takes the calls out of
the text as it streams. A model whose template writes calls some other way is held, when a call is
required, to a bare JSON list of calls.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

from cascadia.grammar import JSON_LAYOUT

ANY_OBJECT: dict[str, Any] = {"type": "object"}
CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
RESULT_OPEN = "<tool_response>"
RESULT_CLOSE = "</tool_response>"


def call_schemas(tools: dict[str, dict[str, Any] | None]) -> dict[str, Any]:
    """One call of any of the tools (name -> parameters schema, None: any object)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters or ANY_OBJECT},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in tools.items()
    ]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def tool_calls_schema(tools: dict[str, dict[str, Any] | None], parallel: bool) -> dict[str, Any]:
    """The JSON schema of an answer that is a bare list of calls: one call, or one or more when calls may
    run in parallel."""
    return {"type": "array", "items": call_schemas(tools), "minItems": 1, **({} if parallel else {"maxItems": 1})}


def markup_grammar(
    tools: dict[str, dict[str, Any] | None], parallel: bool, prose: bool, special: Collection[str] = ()
) -> str:
    """A Lark grammar (llguidance's) of calls in the markup, one per block, blocks a newline apart.

    `prose`: text may come instead, or before the first call; once the text holds `<tool_call>`, what
    follows is a call. Without it the answer opens with a call. `special`: the tags the tokenizer holds
    as tokens of their own, which the grammar then asks for as such (the model writes them that way)."""
    opening, closing = (tag if tag in special else json.dumps(tag) for tag in (CALL_OPEN, CALL_CLOSE))
    call = json.dumps({**call_schemas(tools), "x-guidance": JSON_LAYOUT})
    rules = ["%llguidance {}"]
    if prose and CALL_OPEN in special:  # text cannot spell a token of its own: any text may lead
        rules += [f"start: PROSE | PROSE {opening} block more", "PROSE: /(?s:.*)/"]
    elif prose:
        rules += [
            "start: PROSE | lead block more",
            f"PROSE: /(?s:.*)/ & ~/(?s:.*){CALL_OPEN}(?s:.*)/",
            f"lead[lazy]: /(?s:.*){CALL_OPEN}/",  # ends at the first opening tag, whatever came before it
        ]
    else:
        rules.append(f"start: {opening} block more")
    rules += [
        f'more: ("\\n" {opening} block)*' if parallel else "more: ",
        f'block: "\\n" call "\\n" {closing}',
        f"call: %json {call}",
    ]
    return "\n".join(rules) + "\n"


def openai_call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """A call as OpenAI's `tool_calls` lists it: arguments as JSON text."""
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }


def tool_calls(text: str) -> list[dict[str, Any]]:
    """The calls of an answer held to `tool_calls_schema`, as OpenAI's `tool_calls`.
    Raises ValueError when the text is not such an answer (cut short by max_tokens)."""
    return [openai_call(call["name"], call["arguments"]) for call in json.loads(text)]


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _whole_call(block: str) -> tuple[dict[str, Any], str] | None:
    """The call of a block that opens with `<tool_call>`, and the text after it; None until it is whole
    (or when it is not a call)."""
    body = block[len(CALL_OPEN) :]
    if CALL_CLOSE not in body:
        return None
    try:
        call, end = json.JSONDecoder().raw_decode(body.lstrip())
    except json.JSONDecodeError:
        return None
    rest = body.lstrip()[end:].lstrip()
    if not rest.startswith(CALL_CLOSE) or not isinstance(call, dict):
        return None
    name, arguments = call.get("name"), call.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return openai_call(name, arguments), rest[len(CALL_CLOSE) :]


class CallReader:
    """Splits a model's text into prose and calls in the markup, as it arrives.

    `feed` returns the parts that are settled: prose (str) and whole calls (OpenAI's dicts). Text that
    could still open a call is held back until it does or cannot; a call that never closes (the answer
    was cut short) comes back from `close` as the text the model wrote."""

    def __init__(self) -> None:
        self.held = ""
        self.calls = 0

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        self.held += text
        parts: list[str | dict[str, Any]] = []
        while True:
            if self.calls:  # the newlines between calls are markup, not prose
                self.held = self.held.lstrip()
            at = self.held.find(CALL_OPEN)
            if at < 0:
                settled = len(self.held) - _held_back(self.held, CALL_OPEN)
                if settled:
                    parts.append(self.held[:settled])
                    self.held = self.held[settled:]
                return parts
            if at:
                parts.append(self.held[:at])
                self.held = self.held[at:]
            whole = _whole_call(self.held)
            if whole is None:
                return parts
            call, self.held = whole
            parts.append(call)
            self.calls += 1

    def close(self) -> list[str | dict[str, Any]]:
        held, self.held = self.held, ""
        return [held] if held else []


class ListReader:
    """A bare JSON list of calls (`tool_calls_schema`), read as `CallReader` reads the markup: nothing is
    settled until the answer ends; then its calls, or the text as written when it is not a whole list
    (cut short)."""

    def __init__(self) -> None:
        self.held = ""
        self.calls = 0

    def feed(self, text: str) -> list[str | dict[str, Any]]:
        self.held += text
        return []

    def close(self) -> list[str | dict[str, Any]]:
        held, self.held = self.held, ""
        try:
            calls = tool_calls(held)
        except (ValueError, KeyError, TypeError):
            return [held] if held else []
        self.calls = len(calls)
        return list(calls)


def read_calls(reader: CallReader | ListReader, text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole answer's prose and calls, as `reader` reads them."""
    parts = [*reader.feed(text), *reader.close()]
    return "".join(p for p in parts if isinstance(p, str)), [p for p in parts if isinstance(p, dict)]


def split_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """An answer's prose and whole calls in the markup."""
    return read_calls(CallReader(), text)


def tools_instructions(tools: Iterable[dict[str, Any]]) -> str:
    """What a model whose chat template has no place for tools is told: the functions it may call, and the
    markup of a call."""
    return "\n".join(
        [
            "You can call functions to help answer. Each one is described on its own line:",
            "<tools>",
            *(json.dumps(tool["function"]) for tool in tools),
            "</tools>",
            f"To call functions, answer with one {CALL_OPEN}{CALL_CLOSE} block per call, each holding the "
            "function's name and its arguments as a JSON object:",
            CALL_OPEN,
            '{"name": "<function name>", "arguments": {"<argument>": "<value>"}}',
            CALL_CLOSE,
            f"A function's result comes back to you between {RESULT_OPEN} and {RESULT_CLOSE}.",
        ]
    )


def _call_block(call: dict[str, Any]) -> str:
    function = call["function"]
    arguments = function["arguments"]
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # otherwise written as the client sent it
            arguments = json.loads(arguments)
    return f"{CALL_OPEN}\n{json.dumps({'name': function['name'], 'arguments': arguments})}\n{CALL_CLOSE}"


def with_tools_in_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Messages for a template that knows neither tools nor calls: the instructions open the system
    message, an assistant's calls are written out in the markup, and tool results become one user turn
    between result tags."""
    out: list[dict[str, Any]] = []
    results: list[str] = []  # consecutive tool results, answered in one turn
    for message in messages:
        if message["role"] == "tool":
            results.append(f"{RESULT_OPEN}\n{message.get('content') or ''}\n{RESULT_CLOSE}")
            continue
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results = []
        text = {k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}
        if calls := message.get("tool_calls"):
            text["content"] = "\n".join(
                [*([message["content"]] if message.get("content") else []), *map(_call_block, calls)]
            )
        out.append(text)
    if results:
        out.append({"role": "user", "content": "\n".join(results)})
    if tools:
        instructions = tools_instructions(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{instructions}\n\n{out[0].get('content') or ''}".rstrip()}
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


@dataclass(frozen=True)
class ToolAnswer:
    """How an answer that calls tools is held and read: `markup`, calls in `<tool_call>` blocks (text may
    come first under tool_choice auto); otherwise a bare JSON list of calls."""

    grammar: str
    markup: bool

    def reader(self) -> CallReader | ListReader:
        return CallReader() if self.markup else ListReader()


class AnswerReader:
    """One streamed answer read as it arrives: its prose, its calls once each is whole, and its finish
    reason ("tool_calls" for an answer that stopped after calling)."""

    def __init__(self, tools: ToolAnswer | None) -> None:
        self._reader = tools.reader() if tools is not None else None

    def parts(self, text: str, finish: str | None) -> tuple[list[str | dict[str, Any]], str | None]:
        """The settled prose and whole calls in the order the model wrote them, and the finish reason."""
        reader = self._reader
        if reader is None:
            return ([text] if text else []), finish
        parts = [*reader.feed(text), *(reader.close() if finish else ())]
        if finish == "stop" and reader.calls:
            finish = "tool_calls"
        return parts, finish

    def feed(self, text: str, finish: str | None) -> tuple[str, list[dict[str, Any]], str | None]:
        """The settled prose joined, the whole calls, and the finish reason."""
        parts, finish = self.parts(text, finish)
        prose = "".join(p for p in parts if isinstance(p, str))
        return prose, [p for p in parts if isinstance(p, dict)], finish

    @property
    def calls(self) -> int:
        return self._reader.calls if self._reader is not None else 0


def answer_message(text: str, finish_reason: str | None, tools: ToolAnswer | None) -> tuple[dict[str, Any], str | None]:
    """The assistant's message and finish reason: whole calls become `tool_calls`; a call cut short (by
    max_tokens or a stop string) stays content, as the model wrote it."""
    if tools is None:
        return {"content": text}, finish_reason
    prose, calls = read_calls(tools.reader(), text)
    if not calls:
        return {"content": text}, finish_reason
    finish = "tool_calls" if finish_reason == "stop" else finish_reason
    return {"content": prose if prose.strip() else None, "tool_calls": calls}, finish
