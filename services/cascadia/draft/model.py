"""A small draft language model on the CPU: it continues the stream's text, re-encoded into the target's tokens.

The draft model need not share the target's vocabulary: the target's recent tokens are decoded to
text, encoded with the draft model's tokenizer, continued greedily, and the continuation encoded
back with the target's tokenizer. Each stream keeps its state in the draft engine, so a proposal
costs only the new tokens and the drafted ones; drafted positions are rewound afterwards.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.settings import EngineSettings

EXTRA_DRAFTED = 2  # draft-model tokens beyond k: re-encoding may need them to make k target tokens


class Codec(Protocol):
    """A model's tokenizer as the drafter uses it (`cascadia.gateway.text.TextCodec`)."""

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]: ...
    def decode(self, ids: Sequence[int], keep_special: bool = False) -> str: ...


class EngineDrafter:
    """`codec` is the draft model's tokenizer, `target` the served model's."""

    def __init__(self, model: Path, target: Codec, codec: Codec, device: str = "CPU", window: int = 512) -> None:
        from cascadia.model.loader import load_shape, load_stage

        shape = load_shape(model)
        self.codec = codec
        self.target = target
        self.window = window
        self.engine = StageEngine(
            load_stage(model, 0, shape.num_layers), EngineSettings(device=device, context=window + 64)
        )
        self._fed: dict[str, list[int]] = {}  # draft-model tokens each stream's state holds

    def draft(self, context: Sequence[int], k: int, stream: str = "draft") -> list[int]:
        # the tail starts at a multiple of a quarter window: from one proposal to the next it grows
        # rather than slides, so the stream's state in the draft engine is kept, not prefilled again
        quarter = self.window // 4
        cut = max(0, len(context) - 2 * quarter)
        tail = list(context[cut - cut % quarter :])
        # special tokens stay in the text: a chat's markup must survive the round trip too
        text = self.target.decode(tail, keep_special=True)
        if self.target.encode(text, add_bos=False) != tail:
            return []  # the tail does not survive a round trip through text: nothing aligns
        ids = self.codec.encode(text, add_bos=False)
        if not ids or len(ids) > self.window:  # another tokenizer may take more tokens than the room
            return []
        generated = self._continue(stream, ids, k + EXTRA_DRAFTED)
        full = self.target.encode(text + self.codec.decode(generated, keep_special=True), add_bos=False)
        if full[: len(tail)] != tail:
            return []
        return full[len(tail) : len(tail) + k]

    def forget(self, stream: str) -> None:
        if self._fed.pop(stream, None) is not None:
            self.engine.close(stream)

    def _continue(self, stream: str, ids: list[int], n: int) -> list[int]:
        fed = self._fed.get(stream)
        common = 0
        if fed is not None:
            limit = min(len(fed), len(ids) - 1)  # at least one new token feeds the next logits
            while common < limit and fed[common] == ids[common]:
                common += 1
            if len(fed) - common > self.engine.settings.rewind_slack - n or common == 0:
                self.forget(stream)
                fed = None
                common = 0
        if fed is None:
            self.engine.open(stream)
        else:
            self.engine.rewind(stream, common)
        new = np.asarray(ids[common:], dtype=np.int64)
        logits = self.engine.step([Segment(stream, common, len(new))], new, np.array([len(new) - 1])).logits
        out = [int(np.argmax(logits[0]))]
        position = len(ids)
        for _ in range(n - 1):
            logits = self.engine.step([Segment(stream, position, 1)], np.array([out[-1]])).logits
            out.append(int(np.argmax(logits[0])))
            position += 1
        self.engine.rewind(stream, len(ids))  # the drafted tokens are not part of the stream's text
        self._fed[stream] = list(ids)
        return out
