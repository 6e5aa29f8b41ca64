"""`cascadia bench spec`: speculative decoding against the same fleet without it, per prompt family.

One local fleet, one router driver that speculates; the baseline is the same requests with
speculation switched off per request, interleaved with the speculative ones, so both see the same
machine. Lone streams for the per-request speedup; many concurrent streams for the aggregate rate.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console

from cascadia.bench.report import pyplot, write_report
from cascadia.grammar import json_grammar
from cascadia.sampling_params import SamplingParams

PASSAGE = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick, polished the lens and watched the ships pass safely by."
)
CODE = (
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(value)\n"
)
PATTERN = "Continue the sequence: red, green, blue, red, green, blue, red, green, blue, red,"
FREE = "Write a short story about a dragon who learns to bake bread."
COPY_ASK = "Copy the text below exactly."
EDIT_ASK = "Fix the bug in this function and print the whole corrected function."
JSON_ASK = "Describe Paris as JSON: its country, population and three landmarks."
# the "json" family answers held to this schema (a response_format): its keys and punctuation are
# what the grammar drafts on its own
CITY_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
        "population_millions": {"type": "integer", "minimum": 0, "maximum": 99},
        "landmarks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 32},
                    "kind": {"enum": ["museum", "tower", "church", "park", "bridge"]},
                },
                "required": ["name", "kind"],
                "additionalProperties": False,
            },
            "maxItems": 3,
        },
    },
    "required": ["city", "country", "population_millions", "landmarks"],
    "additionalProperties": False,
}
# each family as a user's message, sent as /v1/chat/completions sends it: through the model's chat
# template, ending where the model ends its turn
CHAT_FAMILIES: dict[str, str] = {
    "copy": f"{COPY_ASK}\n\n{PASSAGE}",
    "edit": f"{EDIT_ASK}\n\n{CODE}",
    "rewrite": f'Rewrite the text below, replacing the word "keeper" with "guardian".\n\n{PASSAGE}',
    "pattern": PATTERN,
    "free": FREE,
    "json": JSON_ASK,
}
# the same asks as raw prompts for /v1/completions, decoding `new_tokens` whatever the model says
COMPLETION_FAMILIES: dict[str, str] = {
    "copy": f"{COPY_ASK}\n\nText: {PASSAGE}\n\nCopy: ",
    "edit": f"{EDIT_ASK}\n\n{CODE}\nCorrected:\n",
    "rewrite": f"Repeat this sentence word for word, then stop.\n{PASSAGE}\nRepeated:\n",
    "pattern": PATTERN,
    "free": FREE,
    "json": f"{JSON_ASK}\n",
}
FORMS = ("chat", "completion")
FAMILIES = tuple(CHAT_FAMILIES)
VERIFY_SIZES = (2, 4, 8, 12, 16)  # rows of a verify block: 1 to 15 drafted tokens


@dataclass(frozen=True)
class SpecBenchConfig:
    model: Path
    out: Path
    shards: int = 3
    new_tokens: int = 64
    repeats: int = 3
    streams: int = 32
    max_draft: int | None = None  # None: as many as the draft rows allow a lone stream
    draft_rows: int | None = None  # None: the local fleet's schedule
    form: str = "chat"  # one of FORMS
    families: tuple[str, ...] = FAMILIES  # which families run, each alone and in the aggregate
    draft_model: Path | None = None  # a small model drafting when no match does (the draft service's --model)


def family_prompts(codec, form: str, new_tokens: int) -> dict[str, tuple[list[int], SamplingParams]]:
    """Each family's prompt ids and greedy sampling: chat messages stop at the end of the model's turn;
    the json family's answer is held to `CITY_SCHEMA` and ends with it."""
    if form not in FORMS:
        raise ValueError(f"form '{form}' is not one of {', '.join(FORMS)}")
    chat = form == "chat"
    params = SamplingParams(max_tokens=new_tokens, stop_ids=codec.stop_token_ids if chat else frozenset())
    shaped = replace(params, stop_ids=codec.stop_token_ids, grammar=json_grammar(CITY_SCHEMA))
    texts = CHAT_FAMILIES if chat else COMPLETION_FAMILIES
    return {
        family: (
            codec.encode_chat([{"role": "user", "content": text}]) if chat else codec.encode(text),
            shaped if family == "json" else params,
        )
        for family, text in texts.items()
    }


async def _one(driver, rid: str, prompt: list[int], params: SamplingParams, speculate: bool) -> dict[str, float]:
    from cascadia.router.scheduler import Request

    started = time.perf_counter()
    result = await driver.generate(Request(rid, tuple(prompt), params, speculate))
    end = time.perf_counter()
    decode = (len(result.tokens) - 1) / (end - result.first_token_at) if end > result.first_token_at else 0.0
    return {"tokens": result.tokens, "decode_tokens_per_s": decode, "total_s": end - started}


def _paired(runs: dict[str, list[float]]) -> float:
    """Median of on / off over the interleaved pairs: a slow spell of this machine hits both runs of
    a pair, so the pairs' ratios spread less than the ratio of the two medians."""
    return statistics.median(on / off for off, on in zip(runs["off"], runs["on"], strict=True) if off)


async def _run(config: SpecBenchConfig, driver, codec, console: Console) -> dict[str, Any]:
    out: dict[str, Any] = {"families": {}, "aggregate": {}}
    prompts = {f: v for f, v in family_prompts(codec, config.form, config.new_tokens).items() if f in config.families}
    for family, (prompt, params) in prompts.items():
        runs: dict[str, list[float]] = {"off": [], "on": []}
        sources: dict[str, list[int]] = {}
        same = True
        for i in range(config.repeats):
            base = await _one(driver, f"{family}-off-{i}", prompt, params, False)
            before = {k: list(v) for k, v in driver.spec_by_source.items()}
            spec = await _one(driver, f"{family}-on-{i}", prompt, params, True)
            for source, (proposed, accepted) in driver.spec_by_source.items():
                was = before.get(source, [0, 0])
                counts = sources.setdefault(source, [0, 0])
                counts[0] += proposed - was[0]
                counts[1] += accepted - was[1]
            same &= base["tokens"] == spec["tokens"]
            runs["off"].append(base["decode_tokens_per_s"])
            runs["on"].append(spec["decode_tokens_per_s"])
        off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
        out["families"][family] = {
            "decode_tokens_per_s_off": off,
            "decode_tokens_per_s_on": on,
            "speedup": on / off if off else 0.0,
            "paired_speedup": _paired(runs),
            "identical_greedy_output": same,
            "decoded_tokens": len(base["tokens"]),
            "acceptance_by_source": {s: (a / p if p else 0.0) for s, (p, a) in sources.items()},
            "drafted_by_source": {s: p for s, (p, _) in sources.items()},
        }
        paired = out["families"][family]["paired_speedup"]
        ratio = on / off if off else 0.0
        console.print(f"{family:8s} speedup {ratio:.2f}x, paired {paired:.2f}x ({off:.1f} -> {on:.1f} tok/s)")
    mixed = list(prompts.values())
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for repeat in range(config.repeats):  # interleaved, so a slow spell of the machine hits both modes
        for mode in ("off", "on"):
            requests = [
                _one(driver, f"agg-{mode}-{repeat}-{i}", *mixed[i % len(mixed)], mode == "on")
                for i in range(config.streams)
            ]
            started = time.perf_counter()
            results = await asyncio.gather(*requests)
            elapsed = time.perf_counter() - started
            rates[mode].append(sum(len(r["tokens"]) for r in results) / elapsed)
    for mode, values in rates.items():
        out["aggregate"][mode] = {
            "streams": config.streams,
            "tokens_per_s": statistics.median(values),
            "runs": [round(v, 2) for v in values],
        }
    out["aggregate"]["paired_ratio"] = _paired(rates)
    console.print(f"{config.streams} streams: {out['aggregate']}")
    return out


def run_spec_bench(config: SpecBenchConfig, console: Console) -> dict[str, Any]:
    from cascadia.bench.driving import drive_local_fleet
    from cascadia.bench.verify import measure_verify_cost
    from cascadia.draft.client import LocalProposer
    from cascadia.gateway.text import TextCodec
    from cascadia.router.local import LocalFleet

    config.out.mkdir(parents=True, exist_ok=True)
    codec = TextCodec.from_model(config.model)
    fleet = LocalFleet(config.model, config.shards, "f32")
    # the schedule `cascadia up` gives this fleet, so the figures are what its users get
    # both modes run the same prompts: each run computes its own, none takes over the other's state
    overrides: dict[str, int] = {"max_streams": config.streams, "keep_finished": 0}
    if config.draft_rows is not None:
        overrides["draft_rows"] = config.draft_rows
    scheduler = fleet.scheduler_config(**overrides).speculating(config.max_draft)
    proposer = None
    if config.draft_model is not None:
        from cascadia.draft.model import EngineDrafter
        from cascadia.draft.proposer import HybridProposer

        with console.status(f"loading the draft model {config.draft_model.name}"):
            own = TextCodec.from_model(config.draft_model)
            proposer = HybridProposer(model=EngineDrafter(config.draft_model, codec, own))
    fleet.start(log_dir=config.out)

    async def run(driver) -> dict[str, Any]:
        await _one(driver, "warm-up", codec.encode("Hello"), SamplingParams(max_tokens=8), True)
        return await _run(config, driver, codec, console)

    results = drive_local_fleet(fleet, scheduler, console, run, LocalProposer(proposer))
    # measured after the fleet stops, so the one process has the cores to itself
    results["verify_cost"] = measure_verify_cost(config.model, VERIFY_SIZES, 5 * config.repeats, console)
    summary = {
        "model": config.model.name,
        "shards": config.shards,
        "new_tokens": config.new_tokens,
        "form": config.form,
        "draft_model": None if config.draft_model is None else config.draft_model.name,
        "max_draft": scheduler.max_draft,
        "draft_rows": scheduler.draft_room,
        "rows_per_group": scheduler.rows_per_group,
        "frames_in_flight": scheduler.in_flight,
        **results,
    }
    write_report(config.out, "spec", summary, _plot)
    return summary


def _plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    families = list(summary["families"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].bar(families, [summary["families"][f]["speedup"] for f in families])
    axes[0].axhline(1.0, color="grey", linewidth=1)
    axes[0].set_ylabel("decode speedup, one stream (x)")
    aggregate = summary["aggregate"]
    axes[1].bar(["off", "on"], [aggregate["off"]["tokens_per_s"], aggregate["on"]["tokens_per_s"]])
    axes[1].set_ylabel(f"aggregate tok/s, {aggregate['on']['streams']} streams")
    cost = summary["verify_cost"]
    for key, label in (("steady_vs_one_row", "back to back"), ("after_one_row_vs_one_row", "after a one-row step")):
        axes[2].plot([int(r) for r in cost[key]], list(cost[key].values()), marker="o", label=label)
    axes[2].set_xlabel("rows of one stream's step (drafts + 1)")
    axes[2].set_ylabel("step time / one-row step, one process")
    axes[2].legend()
    fig.suptitle(f"Speculative decoding on {summary['model']} across {summary['shards']} shards")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
