"""`cascadia bench load`: many streaming clients against the gateway of a local fleet.

Each round sends `clients` concurrent streaming completions through the official `openai` client,
with prompts of mixed lengths and a share of clients that hang up after a few tokens. Reported per
round: completed / failed / cancelled, aggregate tok/s, time-to-first-token and inter-token
percentiles, and the resident memory of every fleet process before and after, so that state that
is not freed shows up as growth across rounds.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from rich.console import Console

from cascadia.bench.report import pyplot, write_report
from cascadia.parent import child_env
from cascadia.router.local import free_port


@dataclass(frozen=True)
class LoadBenchConfig:
    model: Path
    out: Path
    shards: int = 3
    clients: tuple[int, ...] = (1, 32, 176)
    rounds: int = 2
    max_tokens: int = 32
    prompt_min: int = 16
    prompt_max: int = 512
    cancel_share: float = 0.1
    seed: int = 0


@dataclass
class RequestOutcome:
    status: str  # completed, failed, cancelled
    tokens: int = 0
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)
    error: str = ""


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def summarise(outcomes: list[RequestOutcome], elapsed: float) -> dict[str, Any]:
    tokens = sum(o.tokens for o in outcomes)
    return {
        "completed": sum(o.status == "completed" for o in outcomes),
        "failed": sum(o.status == "failed" for o in outcomes),
        "cancelled": sum(o.status == "cancelled" for o in outcomes),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
        "ttft_s": percentiles([o.ttft_s for o in outcomes if o.ttft_s is not None]),
        "inter_token_s": percentiles([g for o in outcomes for g in o.gaps_s]),
    }


async def _one(client, model: str, prompt: list[int], max_tokens: int, hang_up_after: int | None) -> RequestOutcome:
    import openai

    outcome = RequestOutcome("completed")
    started = last = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
        )
        async for _ in stream:
            now = time.perf_counter()
            if outcome.ttft_s is None:
                outcome.ttft_s = now - started
            else:
                outcome.gaps_s.append(now - last)
            last = now
            outcome.tokens += 1
            if hang_up_after is not None and outcome.tokens >= hang_up_after:
                await stream.close()
                outcome.status = "cancelled"
                break
    except openai.APIError as exc:
        outcome.status, outcome.error = "failed", f"{type(exc).__name__}: {exc}"[:200]
    return outcome


async def run_round(base_url: str, clients: int, config: LoadBenchConfig, rng: np.random.Generator) -> dict:
    import openai

    prompts = [
        [int(t) for t in rng.integers(3, 250, size=int(rng.integers(config.prompt_min, config.prompt_max + 1)))]
        for _ in range(clients)
    ]
    hang_ups = [int(rng.integers(1, 4)) if rng.random() < config.cancel_share else None for _ in range(clients)]
    client = openai.AsyncOpenAI(
        base_url=base_url + "/v1",
        api_key="load",
        max_retries=0,
        timeout=600,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=clients + 8)),
    )
    try:
        model = (await client.models.list()).data[0].id
        started = time.perf_counter()
        outcomes = await asyncio.gather(
            *(_one(client, model, p, config.max_tokens, h) for p, h in zip(prompts, hang_ups, strict=True))
        )
    finally:
        await client.close()
    return summarise(list(outcomes), time.perf_counter() - started)


def fleet_memory(root: psutil.Process) -> dict[str, int]:
    """Resident bytes of every process of the fleet, by its role."""
    out = {}
    for proc in root.children(recursive=True):
        try:
            cmd = proc.cmdline()
            role = cmd[cmd.index("cascadia.cli") + 1] if "cascadia.cli" in cmd else proc.name()
            if role == "shard":
                role += "-" + cmd[cmd.index("--stage") + 1]
            out[role] = proc.memory_info().rss
        except (psutil.Error, ValueError, IndexError):
            continue
    return out


def wait_until_ready(base: str, process: subprocess.Popen, timeout: float = 300) -> None:
    """Until the gateway at `base` says /readyz 200; fails if `process` (the one serving it) exits."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"{process.args[3] if len(process.args) > 3 else 'the process'} exited with {process.returncode}"
            )
        try:
            reply = httpx.get(base + "/readyz", timeout=2)
            if reply.status_code == 200:
                return
            last = reply.text
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.5)
    raise TimeoutError(f"{base} not ready within {timeout} s (last answer: {last})")


def run_load_bench(config: LoadBenchConfig, console: Console) -> dict[str, Any]:
    config.out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "cascadia.cli",
        "up",
        "--model",
        str(config.model),
        "--shards",
        str(config.shards),
        "--port",
        str(port),
        "--log-dir",
        str(config.out / "logs"),
    ]
    env = {k: v for k, v in os.environ.items() if k != "CASCADIA_API_KEYS"}
    process = subprocess.Popen(cmd, env=child_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    rng = np.random.default_rng(config.seed)
    results: dict[str, Any] = {
        "config": {**asdict(config), "model": str(config.model), "out": str(config.out)},
        "rounds": [],
    }
    try:
        with console.status("starting the fleet"):
            wait_until_ready(base, process)
        root = psutil.Process(process.pid)
        for clients in config.clients:
            for round_index in range(config.rounds):
                before = fleet_memory(root)
                with console.status(f"{clients} clients, round {round_index + 1}/{config.rounds}"):
                    summary = asyncio.run(run_round(base, clients, config, rng))
                time.sleep(1.0)  # let closes reach every stage
                after = fleet_memory(root)
                summary |= {"clients": clients, "round": round_index, "rss_before": before, "rss_after": after}
                results["rounds"].append(summary)
                console.print(
                    f"{clients:4d} clients round {round_index}: {summary['completed']} completed, "
                    f"{summary['failed']} failed, {summary['cancelled']} cancelled, "
                    f"{summary['tokens_per_s']:.1f} tok/s, TTFT p50 {summary['ttft_s']['p50'] or 0:.3f} s"
                )
    finally:
        process.terminate()
        process.wait(30)
    write_report(config.out, "load", results, _plot)
    return results


def _plot(results: dict[str, Any], path: Path) -> None:
    plt = pyplot()

    rounds = results["rounds"]
    fig, (tps, lat) = plt.subplots(1, 2, figsize=(10, 4))
    clients = sorted({r["clients"] for r in rounds})
    tps.plot(clients, [np.median([r["tokens_per_s"] for r in rounds if r["clients"] == c]) for c in clients], "o-")
    tps.set(
        xlabel="concurrent streaming clients",
        ylabel="tok/s (median of rounds)",
        xscale="log",
        title="aggregate decode through the gateway",
    )
    for key, label in (("ttft_s", "time to first token p50"), ("inter_token_s", "inter-token p50")):
        lat.plot(
            clients,
            [np.median([r[key]["p50"] or 0 for r in rounds if r["clients"] == c]) for c in clients],
            "o-",
            label=label,
        )
    lat.set(xlabel="concurrent streaming clients", ylabel="seconds", xscale="log", title="latency")
    lat.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
