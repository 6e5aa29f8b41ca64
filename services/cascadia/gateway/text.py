"""Text in and out: the checkpoint's tokenizer and chat template, incremental detokenising, stop strings."""

from __future__ import annotations

import functools
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from cascadia.gateway.tools import CALL_OPEN, with_tools_in_text
from cascadia.tokens import common_prefix

# Used when a model ships no template: role-tagged turns, then the assistant's cue (tools and calls reach
# it as text, as for any template without a place for them)
PLAIN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
# the roles of the messages that open a conversation with its instructions, alike across conversations
INSTRUCTION_ROLES = ("system", "developer")
# what tells whether a template writes tools out
_PROBE_TOOLS = [{"type": "function", "function": {"name": "probe_tool_8c1f", "parameters": {"type": "object"}}}]


class TemplateFailed(ValueError):
    pass


def _raise_exception(message: str) -> None:
    raise TemplateFailed(message)


@functools.lru_cache(maxsize=8)
def _compiled(chat_template: str) -> Template:
    """A chat template compiled once: every request renders it, some twice (its instructions alone)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(chat_template)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} as older tokenizer_config files write it
        return value.get("content")
    return value


@dataclass
class TextCodec:
    tokenizer: Tokenizer
    chat_template: str = PLAIN_CHAT_TEMPLATE
    bos_token: str | None = None
    eos_token: str | None = None
    add_bos: bool = False
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    has_own_template: bool = False

    @classmethod
    def from_model(cls, model: Path) -> TextCodec:
        """The codec of a checkpoint directory or of a GGUF file."""
        if Path(model).suffix == ".gguf" and Path(model).is_file():
            return cls.from_gguf(Path(model))
        return cls.from_directory(Path(model))

    @classmethod
    def from_gguf(cls, path: Path) -> TextCodec:
        from cascadia.model.gguf_file import GgufFile

        gguf = GgufFile(path)
        tokenizer = Tokenizer.from_str(gguf.tokenizer_json())
        config = gguf.tokenizer_config()
        template = config["chat_template"]
        eos_id = gguf.metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            tokenizer=tokenizer,
            chat_template=template or PLAIN_CHAT_TEMPLATE,
            bos_token=config["bos_token"],
            eos_token=config["eos_token"],
            add_bos=config["add_bos_token"] and config["bos_token"] is not None,
            stop_token_ids=frozenset([eos_id] if eos_id is not None else []),
            has_own_template=template is not None,
        )

    @classmethod
    def from_directory(cls, model_dir: Path) -> TextCodec:
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        config: dict[str, Any] = {}
        if (model_dir / "tokenizer_config.json").is_file():
            config = json.loads((model_dir / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (model_dir / "chat_template.jinja").is_file():
            template = (model_dir / "chat_template.jinja").read_text()
        bos, eos = _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        stops = set()
        model_config = model_dir / "config.json"
        if model_config.is_file():
            cfg = json.loads(model_config.read_text())
            cfg = cfg.get("text_config", cfg)
            eos_ids = cfg.get("eos_token_id")
            stops.update(eos_ids if isinstance(eos_ids, list) else [eos_ids] if eos_ids is not None else [])
        if eos is not None and tokenizer.token_to_id(eos) is not None:
            stops.add(tokenizer.token_to_id(eos))
        return cls(
            tokenizer=tokenizer,
            chat_template=template or PLAIN_CHAT_TEMPLATE,
            bos_token=bos,
            eos_token=eos,
            add_bos=bool(config.get("add_bos_token", False)) and bos is not None,
            stop_token_ids=frozenset(stops),
            has_own_template=template is not None,
        )

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        bos_id = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        if (self.add_bos if add_bos is None else add_bos) and bos_id is not None and ids[:1] != [bos_id]:
            ids = [bos_id, *ids]
        return ids

    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str:
        """The text of `ids`; special tokens (chat markup) are dropped unless `keep_special`."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=not keep_special)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the chat template writes tools out itself; when it does not, `render_chat` puts them, and
        the calls and results of the conversation, into the messages' text."""
        probe = [{"role": "user", "content": "hi"}]
        try:
            return self._render(probe, _PROBE_TOOLS) != self._render(probe, None)
        except TemplateFailed:
            return True  # a template that fails on tools has its own idea of them

    @functools.cached_property
    def knows_call_markup(self) -> bool:
        """Whether calls from this model can be read in the `<tool_call>` markup: the template writes that
        markup, or the gateway tells the model about it, and the tokenizer spells it as text (a special
        token would be dropped from the answer's text)."""
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values() if t.special}
        return CALL_OPEN not in special and (not self.takes_tools or CALL_OPEN in self.chat_template)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text of `messages`; `tools` (OpenAI's tool definitions) go to templates that take them,
        and into the text for the others."""
        if not self.takes_tools and (tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)):
            return self._render(with_tools_in_text(messages, tools), None, add_generation_prompt)
        return self._render(messages, tools, add_generation_prompt)

    def instructions_length(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, ids: Sequence[int]
    ) -> int:
        """How many of `ids` (the prompt of `messages`) hold the conversation's opening instructions: its
        leading system and developer messages and the tools, and the next turn's cue (`user:`), as other
        conversations with the same instructions start. 0 without such messages, or where the template
        does not write them first."""
        leading = list(itertools.takewhile(lambda m: m["role"] in INSTRUCTION_ROLES, messages))
        if not leading:
            return 0
        # the next turn's cue is rendered as an empty turn of its role; some templates insist on a user's turn
        cue = [{"role": m["role"], "content": ""} for m in messages[len(leading) : len(leading) + 1]]
        for opening_messages in ([*leading, *cue], leading):
            try:
                opening = self.render_chat(opening_messages, tools, add_generation_prompt=False)
            except TemplateFailed:
                continue
            # the opening's last tokens may merge with what follows them: only the tokens both hold count
            return common_prefix(self.encode(opening, add_bos=False), ids)
        return 0

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool = True
    ) -> str:
        try:
            return _compiled(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except TemplateError as exc:
            raise TemplateFailed(f"the chat template failed: {exc}") from None

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # templates put BOS into the text themselves; do not add a second one
        return self.encode(self.render_chat(messages, tools), add_bos=False)


class IncrementalDetokenizer:
    """Text of a growing token sequence, released only once it is whole UTF-8.

    Byte-level tokens can split a character; decoding them alone gives U+FFFD. Text is held back
    while the decoded tail ends in one, and a short window of earlier tokens is re-decoded so that
    tokenizers which join tokens with context (spaces, merges) produce the same text as one decode.
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec
        self.ids: list[int] = []
        self._prefix = 0  # start of the window that is re-decoded
        self._read = 0  # tokens whose text was released

    def push(self, token: int) -> str:
        self.ids.append(token)
        prefix_text = self.codec.decode(self.ids[self._prefix : self._read])
        full_text = self.codec.decode(self.ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back, at the end of the sequence."""
        prefix_text = self.codec.decode(self.ids[self._prefix : self._read])
        full_text = self.codec.decode(self.ids[self._prefix :])
        self._prefix = self._read = len(self.ids)
        return full_text[len(prefix_text) :]


class StopMatcher:
    """Finds stop strings in streamed text, even when one spans several pieces.

    Text that could still be the start of a stop string is held back until it is known not to be.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        buffer = self._held + text
        hits = [(buffer.find(s), s) for s in self.stops if s in buffer]
        if hits:
            at = min(i for i, _ in hits)
            self.stopped = True
            self._held = ""
            return buffer[:at]
        keep = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buffer)), 0, -1):
                if buffer.endswith(stop[:n]):
                    keep = max(keep, n)
                    break
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
