"""Tool calls held to a grammar: with `tool_choice` "required" or a named function, the answer is a JSON
list of calls whose names and arguments match the tools' schemas, whatever markup the model would use."""

from __future__ import annotations

import json
import uuid
from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def tool_calls_schema(tools: dict[str, dict[str, Any] | None], parallel: bool) -> dict[str, Any]:
    """The JSON schema of an answer that calls the given tools (name -> parameters schema, None: any
    object): a list of one call, or of one or more when calls may run in parallel."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters or ANY_OBJECT},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in tools.items()
    ]
    call = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def tool_calls(text: str) -> list[dict[str, Any]]:
    """The calls of an answer held to `tool_calls_schema`, as OpenAI's `tool_calls` (arguments as JSON text).
    Raises ValueError when the text is not such an answer (cut short by max_tokens)."""
    calls = json.loads(text)
    return [
        {
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])},
        }
        for call in calls
    ]
