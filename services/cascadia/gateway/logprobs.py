"""Log-probs in the shapes OpenAI's endpoints give them."""

from __future__ import annotations

from cascadia.gateway.generation import TokenLogprob
from cascadia.gateway.schemas import ChoiceLogprobs, CompletionLogprobs, TopLogprob
from cascadia.gateway.schemas import TokenLogprob as TokenLogprobBody


def token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(tokens: list[TokenLogprob]) -> ChoiceLogprobs:
    content = [
        TokenLogprobBody(
            token=t.text,
            logprob=t.logprob,
            bytes=token_bytes(t.text),
            top_logprobs=[TopLogprob(token=s, logprob=lp, bytes=token_bytes(s)) for s, lp in t.top or ()],
        )
        for t in tokens
    ]
    return ChoiceLogprobs(content=content)


def completion_logprobs(tokens: list[TokenLogprob], offset: int, wants_top: bool) -> CompletionLogprobs:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return CompletionLogprobs(
        tokens=[t.text for t in tokens],
        token_logprobs=[t.logprob for t in tokens],
        top_logprobs=[None if t.top is None else dict(t.top) for t in tokens] if wants_top else None,
        text_offset=offsets,
    )
