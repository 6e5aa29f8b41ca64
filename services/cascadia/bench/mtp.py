"""`cascadia bench mtp`: what drafting with the model's own MTP head costs on the last stage, and how it agrees.

Cost: one decode step of the last stage (its layers and the head, one row per stream) against one
MTP chain round (every depth over the newly confirmed row and the drafted ones, plus the draft
logits), medians over repeated rounds, at several stream counts. Agreement: greedy sequences of the
same checkpoint scored per depth under the teacher-fed and self-fed protocols (on synthetic random
weights the agreement is reported, not a goal).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from cascadia.bench import draft_eval as evaluate
from cascadia.bench.report import pyplot, write_report
from cascadia.engine.batch import Segment
from cascadia.engine.engine import StageEngine
from cascadia.engine.generate import generate
from cascadia.engine.mtp import MtpDrafter, MtpHead
from cascadia.engine.settings import EngineSettings
from cascadia.model.checkpoint import load_mtp
from cascadia.model.loader import load_shape, load_stage
from cascadia.sampling_params import SamplingParams
from cascadia.shard.capture import ConfirmedStream


@dataclass(frozen=True)
class MtpBenchConfig:
    model: Path
    out: Path
    streams: tuple[int, ...] = (1, 8)
    stage_layers: int = 6  # the last stage's share of the model (the 975B fleet runs 6 per node)
    rounds: int = 20
    sequences: int = 4
    new_tokens: int = 48
    prompt_tokens: int = 32
    vocab_prefix: int = 0  # also time the chain with draft logits over the first N ids only


def _median_ms(samples: list[float]) -> float:
    return 1000.0 * statistics.median(samples)


def _time_last_stage(engine: StageEngine, streams: int, rounds: int, hidden: int) -> float:
    """One decode row per stream through the last stage and its head."""
    rng = np.random.default_rng(0)
    names = [f"s{i}" for i in range(streams)]
    for name in names:
        engine.open(name)
        engine.step([Segment(name, 0, 16)], rng.standard_normal((16, hidden)).astype(np.float32))
    samples = []
    for r in range(rounds + 2):
        rows = rng.standard_normal((streams, hidden)).astype(np.float32)
        started = time.perf_counter()
        engine.step([Segment(n, 16 + r, 1) for n in names], rows)
        samples.append(time.perf_counter() - started)
    for name in names:
        engine.close(name)
    return _median_ms(samples[2:])


def _time_chain(head: MtpHead, streams: int, rounds: int, hidden: int, vocab: int) -> float:
    """One live round per stream: confirm the new row and token, draft every depth."""
    rng = np.random.default_rng(1)
    drafter = MtpDrafter(head)
    names = [f"s{i}" for i in range(streams)]
    for name in names:
        drafter.open(name)
        drafter.confirm(name, 0, rng.standard_normal((16, hidden)).astype(np.float32), rng.integers(3, vocab, 16))
        drafter.sampled(name, int(rng.integers(3, vocab)))
        drafter.propose({name: head.depths})
    samples = []
    for r in range(rounds + 2):
        for name in names:
            drafter.confirm(
                name, 16 + r, rng.standard_normal((1, hidden)).astype(np.float32), [int(rng.integers(3, vocab))]
            )
            drafter.sampled(name, int(rng.integers(3, vocab)))
        started = time.perf_counter()
        drafter.propose(dict.fromkeys(names, head.depths))
        samples.append(time.perf_counter() - started)
    for name in names:
        drafter.close(name)
    return _median_ms(samples[2:])


def _greedy_streams(config: MtpBenchConfig, console: Console) -> dict[str, ConfirmedStream]:
    """Greedy continuations of random prompts, with the final states of every confirmed row."""
    shape = load_shape(config.model)
    whole = StageEngine(load_stage(config.model, 0, shape.num_layers), EngineSettings())
    rng = np.random.default_rng(2)
    out = {}
    for i in range(config.sequences):
        prompt = [1, *rng.integers(3, shape.unpadded_vocab_size, config.prompt_tokens - 1).tolist()]
        generated = generate(whole, prompt, SamplingParams(max_tokens=config.new_tokens)).token_ids
        tokens = prompt + generated
        whole.open("replay")
        final = whole.step([Segment("replay", 0, len(tokens) - 1)], np.asarray(tokens[:-1])).hidden
        whole.close("replay")
        out[f"seq{i}"] = ConfirmedStream(tokens, final, len(prompt))
        console.print(f"sequence {i + 1}/{config.sequences}: {len(generated)} greedy tokens")
    return out


def run_mtp_bench(config: MtpBenchConfig, console: Console) -> dict[str, Any]:
    shape = load_shape(config.model)
    if not shape.mtp_depths:
        raise ValueError(f"{config.model} has no MTP head")
    settings = EngineSettings()
    start = max(1, shape.num_layers - config.stage_layers)  # a middle-to-last stage: its input is FP32 rows
    console.print(f"loading the last stage (layers {start}:{shape.num_layers}) and {shape.mtp_depths} MTP depths")
    stage = StageEngine(load_stage(config.model, start, shape.num_layers), settings)
    weights = load_mtp(config.model)
    head = MtpHead(weights, settings)
    prefix_head = MtpHead(weights, settings, config.vocab_prefix) if config.vocab_prefix else None
    cost = []
    for streams in config.streams:
        step_ms = _time_last_stage(stage, streams, config.rounds, shape.hidden_size)
        chain_ms = _time_chain(head, streams, config.rounds, shape.hidden_size, shape.unpadded_vocab_size)
        row = {"streams": streams, "last_stage_step_ms": step_ms, "mtp_chain_ms": chain_ms}
        line = (
            f"{streams} streams: last stage step {step_ms:.2f} ms, MTP chain of {head.depths} depths {chain_ms:.2f} ms"
        )
        if prefix_head is not None:
            row["mtp_chain_prefix_ms"] = _time_chain(
                prefix_head, streams, config.rounds, shape.hidden_size, shape.unpadded_vocab_size
            )
            line += f", over the first {config.vocab_prefix} ids {row['mtp_chain_prefix_ms']:.2f} ms"
        cost.append(row)
        console.print(line)
    streams = _greedy_streams(config, console)
    teacher = evaluate.mtp_teacher_fed(head, streams).as_dict()
    self_fed = evaluate.mtp_self_fed(head, streams).as_dict()
    summary = {
        "model": str(config.model),
        "stage_layers": f"{start}:{shape.num_layers}",
        "depths": head.depths,
        "vocab_prefix": config.vocab_prefix or None,
        "cost": cost,
        "agreement": {"teacher-fed": teacher, "self-fed": self_fed},
        "teacher_minus_self_fed": [
            (t - s) if t is not None and s is not None else None
            for t, s in zip(teacher["agreement_per_depth"], self_fed["agreement_per_depth"], strict=True)
        ],
    }
    config.out.mkdir(parents=True, exist_ok=True)
    write_report(config.out, "mtp", summary, _plot)
    return summary


def _plot(summary: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    cost = summary["cost"]
    x = np.arange(len(cost))
    bars = [("last_stage_step_ms", f"last stage ({summary['stage_layers']})")]
    bars.append(("mtp_chain_ms", f"MTP chain ({summary['depths']} depths)"))
    if summary.get("vocab_prefix"):
        bars.append(("mtp_chain_prefix_ms", f"MTP chain, first {summary['vocab_prefix']} ids"))
    width = 0.8 / len(bars)
    for i, (key, label) in enumerate(bars):
        axes[0].bar(x + (i - (len(bars) - 1) / 2) * width, [c[key] for c in cost], width, label=label)
    axes[0].set_xticks(x, [f"{c['streams']} streams" for c in cost])
    axes[0].set_ylabel("ms per round (median)")
    axes[0].legend(fontsize="small")
    depths = np.arange(summary["depths"])
    for name, score in summary["agreement"].items():
        values = [v if v is not None else np.nan for v in score["agreement_per_depth"]]
        axes[1].plot(depths, values, "o-", label=name)
    axes[1].set_xlabel("depth")
    axes[1].set_ylabel("agreement with the greedy token")
    axes[1].set_xticks(depths)
    axes[1].legend(fontsize="small")
    fig.suptitle(f"MTP drafting ({Path(summary['model']).name})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
