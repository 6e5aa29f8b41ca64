"""`cascadia bench prefix`: prompts that start alike, computed once and every time.

One local fleet and one router driver. Each round sends the same users' questions after one system
prompt, one after the other, three times: with the router keeping finished streams and copies of the
prefixes prompts share (its defaults) and each request saying where its system message ends, as the
gateway says it; the same with nothing said, so that the router finds the shared part only once two
prompts part after it; and with nothing kept (`--keep-finished 0`), each round starting with the next
of the three. Then it asks one question for several sampled choices at once (a request's `n`), twice:
with the later choices starting as copies of the first, and with every choice computing its prompt.
Every round and mode opens its system prompt with a name of its own, so each starts with nothing the
router has seen. Times are compared within the round, so a slow spell of the machine hits both modes
of the pair.
"""

from __future__ import annotations

import asyncio
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from cascadia.bench.turns import KEEP, OPENING
from cascadia.sampling_params import SamplingParams

CHOICE = {"temperature": 0.8, "top_p": 0.95}  # how each of a question's choices is sampled

QUESTIONS = (
    "Who opens the shutters?",
    "What happens at noon?",
    "Which animals are in it?",
    "When are the lamps lit?",
    "Where do the traders come from?",
    "Give the passage a title.",
    "What do the fishermen do?",
    "Summarise it in one sentence.",
)


@dataclass(frozen=True)
class PrefixBenchConfig:
    model: Path
    out: Path
    shards: int
    users: int  # questions asked after one system prompt, one after the other
    choices: int  # sampled choices of one question, asked at once
    repeats: int
    answer_tokens: int  # past the rewind slack, so that no user's finished stream serves the next one
    system_repeats: int  # how many times the system prompt says its passage: the shared prefix's length


def system_prompt(name: str, repeats: int) -> str:
    return f"You are the {name} desk. Answer questions about this passage. " + OPENING * repeats


async def _users(
    driver, codec, config: PrefixBenchConfig, system: str, tag: str, announce: bool = True
) -> list[dict[str, Any]]:
    from cascadia.bench.driving import answer

    out = []
    params = SamplingParams(max_tokens=config.answer_tokens, stop_ids=codec.stop_token_ids)
    for user in range(config.users):
        question = QUESTIONS[user % len(QUESTIONS)]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        prompt = codec.encode_chat(messages)
        shared = codec.instructions_length(messages, None, prompt)  # in every mode: the same work between users
        answered = await answer(driver, f"{tag}-{user}", prompt, params, shared_prefix=shared if announce else 0)
        out.append({"prompt_tokens": len(prompt), "cached": answered.cached, "ttft_s": answered.ttft_s})
    return out


async def _choices(driver, codec, config: PrefixBenchConfig, system: str, tag: str) -> dict[str, Any]:
    """One question's choices at once: when the last one's first token came, and when all were done."""
    from cascadia.bench.driving import answer

    prompt = codec.encode_chat([{"role": "system", "content": system}, {"role": "user", "content": QUESTIONS[0]}])
    started = asyncio.get_running_loop().time()
    answered = await asyncio.gather(
        *(
            answer(driver, f"{tag}-{i}", prompt, SamplingParams(**CHOICE, seed=i, max_tokens=config.answer_tokens))
            for i in range(config.choices)
        )
    )
    return {
        "prompt_tokens": len(prompt),
        "cached": [a.cached for a in answered],
        "ttft_s": max(a.ttft_s for a in answered),
        "done_s": asyncio.get_running_loop().time() - started,
    }


def _paired(shared: list[dict[str, Any]], computed: list[dict[str, Any]], key: str = "ttft_s") -> float:
    """The median over rounds of each round's own ratio of times (to the first token by default)."""
    return statistics.median(c[key] / s[key] for s, c in zip(shared, computed, strict=True) if s[key])


async def _run(config: PrefixBenchConfig, driver, codec, console: Console) -> dict[str, Any]:
    base = driver.scheduler.config
    runs: dict[str, list[list[dict[str, Any]]]] = {"shared": [], "found": [], "computed": []}
    choices: dict[str, list[dict[str, Any]]] = {"copied": [], "computed": []}
    modes = [("shared", KEEP), ("found", KEEP), ("computed", 0)]
    for repeat in range(config.repeats):
        # each round starts with the next mode: the first after the choices pays for the stages' pools
        # growing again, which would otherwise always fall on one mode
        turn = repeat % len(modes)
        for mode, keep in modes[turn:] + modes[:turn]:
            driver.scheduler.config = replace(base, keep_finished=keep)
            driver.scheduler.drop_all_kept()
            system = system_prompt(f"{mode} {repeat + 1}", config.system_repeats)
            said = mode == "shared"
            runs[mode].append(await _users(driver, codec, config, system, f"{mode}-{repeat}", announce=said))
        ttft = {mode: [round(u["ttft_s"], 3) for u in r[-1]] for mode, r in runs.items()}
        console.print(f"round {repeat + 1}/{config.repeats}: time to first token by user (s) {ttft}")
        driver.scheduler.config = replace(base, keep_finished=0)
        for mode in choices:
            # with nothing taken over the stages hold each stream from its first position: no copies
            driver.scheduler.taking_over = mode == "copied"
            system = system_prompt(f"{mode} choices {repeat + 1}", config.system_repeats)
            choices[mode].append(await _choices(driver, codec, config, system, f"{mode}-choices-{repeat}"))
        driver.scheduler.taking_over = True
        last = {mode: (round(c[-1]["ttft_s"], 3), round(c[-1]["done_s"], 3)) for mode, c in choices.items()}
        console.print(f"round {repeat + 1}/{config.repeats}: {config.choices} choices, (last first token, done) {last}")
    driver.scheduler.config = base
    users = []
    for user in range(config.users):
        shared, found, computed = ([r[user] for r in runs[mode]] for mode in ("shared", "found", "computed"))
        users.append(
            {
                "user": user + 1,
                "prompt_tokens": shared[0]["prompt_tokens"],
                "cached_tokens": statistics.median(u["cached"] for u in shared),
                "cached_tokens_found": statistics.median(u["cached"] for u in found),
                "ttft_s_shared": statistics.median(u["ttft_s"] for u in shared),
                "ttft_s_found": statistics.median(u["ttft_s"] for u in found),
                "ttft_s_computed": statistics.median(u["ttft_s"] for u in computed),
                "paired_speedup": _paired(shared, computed),
                "paired_speedup_found": _paired(found, computed),
            }
        )
    # told where the system message ends, the first user leaves the copy the later ones start from; found
    # only where two prompts part, the copy comes with the second user, and only the third starts from it
    later = {mode: [u for r in rounds for u in r[1:]] for mode, rounds in runs.items()}
    copied, computed = choices["copied"], choices["computed"]
    n_choices = {
        "choices": config.choices,
        "prompt_tokens": copied[0]["prompt_tokens"],
        "cached_tokens": [statistics.median(c["cached"][i] for c in copied) for i in range(config.choices)],
        "last_first_token_s_copied": statistics.median(c["ttft_s"] for c in copied),
        "last_first_token_s_computed": statistics.median(c["ttft_s"] for c in computed),
        "done_s_copied": statistics.median(c["done_s"] for c in copied),
        "done_s_computed": statistics.median(c["done_s"] for c in computed),
        "paired_first_token_speedup": _paired(copied, computed),
        "paired_done_speedup": _paired(copied, computed, "done_s"),
    }
    return {
        "min_shared_prefix": base.min_shared_prefix,
        "users": users,
        "later_users_paired_speedup": _paired(later["shared"], later["computed"]),
        "later_users_paired_speedup_found": _paired(later["found"], later["computed"]),
        "n_choices": n_choices,
    }


def run_prefix_bench(config: PrefixBenchConfig, console: Console) -> dict[str, Any]:
    from cascadia.bench.driving import chat_fleet_bench

    async def measure(driver, codec) -> dict[str, Any]:
        warm = replace(config, users=1)
        await _users(driver, codec, warm, system_prompt("warm-up", config.system_repeats), "warm-up")
        return await _run(config, driver, codec, console)

    fields = {"answer_tokens": config.answer_tokens, "repeats": config.repeats, "keep_finished": KEEP}
    return chat_fleet_bench(config.model, config.shards, config.out, "prefix", console, measure, _plot, **fields)


def _plot(summary: dict[str, Any], path: Path) -> None:
    from cascadia.bench.driving import panels, plot_reuse

    title = f"Prompts that start alike on {summary['model']} across {summary['shards']} shards"
    with panels(path, 3, title) as axes:
        slow, fast = ("ttft_s_computed", "every prompt computed"), ("ttft_s_shared", "system message's end told")
        found = [("ttft_s_found", "only where prompts part")]
        xlabel = "user after one system prompt (one after the other)"
        plot_reuse(axes, summary["users"], "user", xlabel, slow, fast, found)
        choices = summary["n_choices"]
        spots, width = [0, 1], 0.38
        for offset, mode, colour in ((-width / 2, "computed", "tab:blue"), (width / 2, "copied", "tab:orange")):
            times = [choices[f"last_first_token_s_{mode}"], choices[f"done_s_{mode}"]]
            label = "every choice computes the prompt" if mode == "computed" else "later choices start as copies"
            axes[2].bar([p + offset for p in spots], times, width, label=label, color=colour)
        axes[2].set_xticks(spots, ["last choice's first token", "all choices done"])
        axes[2].set_ylabel("seconds (median)")
        axes[2].set_title(f"one question, {choices['choices']} choices at once", fontsize=10)
        axes[2].legend(loc="upper left")
