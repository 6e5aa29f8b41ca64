"""Constrained decoding: a grammar narrows each sampled row to the tokens that keep the text inside it.

Grammars are llguidance's (JSON schemas, regular expressions, Lark), matched against the model's own
tokenizer, so a token that would leave the grammar is never sampled, however it splits the text. The
request's stop tokens are the grammar's end: they are allowed exactly when the text so far is a whole
match, and they are the only tokens allowed once nothing can extend it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import llguidance
import numpy as np

# JSON as `json.dumps` writes it: a model is never free to fill an answer with whitespace
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    pass


def json_grammar(schema: dict[str, Any] | None) -> str:
    """Text that is one JSON value matching `schema` (None: any JSON object). A schema's own
    `x-guidance` options override the layout."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema or {"type": "object"}, defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise GrammarError(f"not a JSON schema: {exc}") from None


def regex_grammar(pattern: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def choice_grammar(choices: Iterable[str]) -> str:
    """Text that is exactly one of `choices`."""
    return llguidance.grammar_from("choice", json.dumps(list(choices)))


def cfg_grammar(text: str) -> str:
    """A context-free grammar in Lark's syntax or in GBNF (llama.cpp's)."""
    try:
        return llguidance.grammar_from("grammar", text)
    except ValueError as exc:
        raise GrammarError(str(exc)) from None


def check_grammar(grammar: str, vocabulary: GrammarVocabulary | None = None) -> None:
    """Raises GrammarError with the grammar's first error; against a vocabulary, also what its tokens
    cannot spell."""
    if not grammar.strip():
        raise GrammarError("the grammar is empty")
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, vocabulary.tokenizer if vocabulary else None)
    except (ValueError, TypeError) as exc:
        error = str(exc)
    if error:
        raise GrammarError(error)


def tokenizer_json(model: Path) -> str | None:
    """The `tokenizers` JSON of a checkpoint directory or a GGUF file; None when it has none."""
    if model.suffix == ".gguf" and model.is_file():
        from cascadia.model.gguf_file import GgufFile

        return GgufFile(model).tokenizer_json()
    path = model / "tokenizer.json"
    return path.read_text() if path.is_file() else None


class GrammarVocabulary:
    """The model's tokens as the matcher sees them (building it reads the whole vocabulary: once per process).

    `sampled_vocab`: the rows of logits a mask covers. Ids past the tokenizer's own are never allowed.
    """

    def __init__(self, tokenizer_document: str, sampled_vocab: int) -> None:
        size = _vocab_size(tokenizer_document)
        self.tokenizer = llguidance.LLTokenizer(tokenizer_document, n_vocab=max(size, sampled_vocab))
        self.sampled_vocab = sampled_vocab
        ends = np.array(self.tokenizer.eos_tokens, dtype=np.int64)
        self._own_ends = ends[ends < sampled_vocab]

    @classmethod
    def from_model(cls, model: Path, sampled_vocab: int) -> GrammarVocabulary | None:
        document = tokenizer_json(model)
        return cls(document, sampled_vocab) if document is not None else None

    def is_special(self, text: str) -> bool:
        """Whether `text` is one of the tokenizer's added tokens, which a grammar names (`<text>`) rather
        than spells."""
        tokens = self.tokenizer.tokenize_str(text)
        return len(tokens) == 1 and bool(self.tokenizer.is_special_token(tokens[0]))

    def constraint(self, grammar: str, stop_ids: Iterable[int]) -> TokenConstraint:
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return TokenConstraint(matcher, self, frozenset(stop_ids))

    def allowed(self, matcher: llguidance.LLMatcher) -> np.ndarray:
        """The matcher's next tokens as a bool row of `sampled_vocab`, its own end tokens cleared."""
        bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.sampled_vocab].astype(bool)
        allowed[self._own_ends] = False
        return allowed


class TokenConstraint:
    """One stream's place in its grammar. `mask` a row before choosing from it; `advance` by the token chosen."""

    def __init__(self, matcher: llguidance.LLMatcher, vocabulary: GrammarVocabulary, stop_ids: frozenset[int]) -> None:
        if not stop_ids:
            raise GrammarError("a grammar needs a stop token to end on")
        self.matcher = matcher
        self.vocabulary = vocabulary
        self.stops = np.array(sorted(t for t in stop_ids if t < vocabulary.sampled_vocab), dtype=np.int64)
        if not self.stops.size:
            raise GrammarError(f"no stop token among {sorted(stop_ids)} is in the vocabulary")
        self.ended = False  # a stop token was chosen: nothing follows it

    def allowed(self) -> np.ndarray:
        vocab = self.vocabulary.sampled_vocab
        if self.ended or self.matcher.is_stopped():  # complete (or failed): only a stop token may follow
            allowed = np.zeros(vocab, dtype=bool)
        else:
            allowed = self.vocabulary.allowed(self.matcher)
        # a whole match may end here; and a matcher with nothing left to offer ends rather than fails
        if self.ended or self.matcher.is_stopped() or self.matcher.is_accepting() or not allowed.any():
            allowed[self.stops] = True
        return allowed

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A row of `sampled_vocab` logits with every token the grammar refuses at -inf."""
        return np.where(self.allowed(), logits, -np.inf).astype(np.float32)

    def forced(self) -> list[int]:
        """The tokens the grammar allows alone from here on (a key's name, a bracket), in order: drafts
        that cost no model. Their text is forced; the model may still split it otherwise."""
        if self.ended or self.matcher.is_stopped():
            return []
        return [t for t in self.matcher.compute_ff_tokens() if t < self.vocabulary.sampled_vocab]

    def advance(self, token: int) -> None:
        if self.ended or token in self.stops:
            self.ended = True
            return
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} leaves the grammar: {self.matcher.get_error()}")


def _vocab_size(tokenizer_document: str) -> int:
    document = json.loads(tokenizer_document)
    vocab = document.get("model", {}).get("vocab", {})
    size = len(vocab) if isinstance(vocab, list) else max(map(int, vocab.values()), default=-1) + 1  # Unigram: a list
    return max([size, *(int(t["id"]) + 1 for t in document.get("added_tokens", []))])
