"""`cascadia bench turns`: a conversation's turns with the finished streams' state kept, and without.

One local fleet and one router driver. Each round holds the same conversation twice, keeping and not
keeping (`--keep-finished`), one after the other, so a slow spell of the machine hits both; a turn's
time to its first token is compared within the round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from cascadia.sampling_params import SamplingParams

OPENING = (
    "Here is a passage. The harbour town woke slowly: fishermen mended their nets, gulls argued over "
    "scraps, and the baker opened his shutters to the smell of bread. By noon the market filled with "
    "traders from the hills, and by evening the lamps along the quay were lit one by one. "
)
FOLLOW_UPS = (
    "Summarise it in one sentence.",
    "Who opens the shutters?",
    "What happens at noon?",
    "Give the passage a title.",
    "Which animals are in it?",
    "Say it again, shorter.",
)
KEEP = 8  # the router's default


@dataclass(frozen=True)
class TurnsBenchConfig:
    model: Path
    out: Path
    shards: int
    turns: int
    repeats: int
    answer_tokens: int
    opening_repeats: int  # how many times the passage is said in the first message: the history's length


def conversation_turns(turns: int, opening_repeats: int) -> list[str]:
    """The user's messages, first to last."""
    first = OPENING * opening_repeats + "Read it carefully."
    return [first, *(FOLLOW_UPS[i % len(FOLLOW_UPS)] for i in range(turns - 1))]


async def _conversation(driver, codec, config: TurnsBenchConfig, tag: str) -> list[dict[str, Any]]:
    from cascadia.bench.driving import answer

    messages: list[dict[str, Any]] = []
    out = []
    for turn, text in enumerate(conversation_turns(config.turns, config.opening_repeats)):
        messages.append({"role": "user", "content": text})
        prompt = codec.encode_chat(messages)
        params = SamplingParams(max_tokens=config.answer_tokens, stop_ids=codec.stop_token_ids)
        answered = await answer(driver, f"{tag}-{turn}", prompt, params)
        out.append({"prompt_tokens": len(prompt), "cached": answered.cached, "ttft_s": answered.ttft_s})
        messages.append({"role": "assistant", "content": codec.decode(answered.tokens)})
    return out


async def _run(config: TurnsBenchConfig, driver, codec, console: Console) -> dict[str, Any]:
    base = driver.scheduler.config
    runs: dict[str, list[list[dict[str, Any]]]] = {"kept": [], "computed": []}
    for repeat in range(config.repeats):
        for mode, keep in (("kept", KEEP), ("computed", 0)):
            driver.scheduler.config = replace(base, keep_finished=keep)
            driver.scheduler.drop_all_kept()  # every conversation starts on its own
            runs[mode].append(await _conversation(driver, codec, config, f"{mode}-{repeat}"))
        ttft = {mode: [round(t["ttft_s"], 3) for t in r[-1]] for mode, r in runs.items()}
        console.print(f"round {repeat + 1}/{config.repeats}: time to first token by turn (s) {ttft}")
    turns = []
    for turn in range(config.turns):
        kept = [r[turn] for r in runs["kept"]]
        computed = [r[turn] for r in runs["computed"]]
        turns.append(
            {
                "turn": turn + 1,
                "prompt_tokens": kept[0]["prompt_tokens"],
                "cached_tokens": statistics.median(t["cached"] for t in kept),
                "ttft_s_kept": statistics.median(t["ttft_s"] for t in kept),
                "ttft_s_computed": statistics.median(t["ttft_s"] for t in computed),
                # within a round: a slow spell of the machine hits both modes of the pair
                "paired_speedup": statistics.median(
                    c["ttft_s"] / k["ttft_s"] for k, c in zip(kept, computed, strict=True) if k["ttft_s"]
                ),
            }
        )
    return {"turns": turns}


def run_turns_bench(config: TurnsBenchConfig, console: Console) -> dict[str, Any]:
    from cascadia.bench.driving import chat_fleet_bench

    async def measure(driver, codec) -> dict[str, Any]:
        await _conversation(driver, codec, replace(config, turns=1), "warm-up")
        return await _run(config, driver, codec, console)

    fields = {"answer_tokens": config.answer_tokens, "repeats": config.repeats, "keep_finished": KEEP}
    return chat_fleet_bench(config.model, config.shards, config.out, "turns", console, measure, _plot, **fields)


def _plot(summary: dict[str, Any], path: Path) -> None:
    from cascadia.bench.driving import panels, plot_reuse

    title = f"A conversation on {summary['model']} across {summary['shards']} shards"
    with panels(path, 2, title) as axes:
        slow, fast = ("ttft_s_computed", "history computed again"), ("ttft_s_kept", "last turn's state taken over")
        plot_reuse(axes, summary["turns"], "turn", "turn", slow, fast)
