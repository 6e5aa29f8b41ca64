"""`cascadia bench prefix` on the tiny model: every mode runs, and later users start from the kept copy."""

from __future__ import annotations

import json

from rich.console import Console

from cascadia.bench.prefix import PrefixBenchConfig, run_prefix_bench


def test_later_users_start_from_the_system_prompts_copy_from_the_second_when_told_from_the_third_when_found(
    tiny, tmp_path
):
    config = PrefixBenchConfig(
        tiny, tmp_path, shards=2, users=4, choices=3, repeats=1, answer_tokens=40, system_repeats=1
    )
    summary = run_prefix_bench(config, Console(quiet=True))
    assert json.loads((tmp_path / "prefix.json").read_text()) == summary
    assert (tmp_path / "prefix.png").stat().st_size > 0
    first, second, *later = summary["users"]
    assert first["cached_tokens"] == first["cached_tokens_found"] == second["cached_tokens_found"] == 0
    for user in [second, *later]:  # the system prompt at least, and never the last prompt token
        assert summary["min_shared_prefix"] <= user["cached_tokens"] < user["prompt_tokens"]
    for user in later:
        assert summary["min_shared_prefix"] <= user["cached_tokens_found"] < user["prompt_tokens"]
    choices = summary["n_choices"]  # the first computes the prompt, the others start as copies of it
    assert choices["cached_tokens"] == [0] + [choices["prompt_tokens"] - 1] * 2
    for mode in ("copied", "computed"):  # every answer is done only after every first token came
        assert choices[f"done_s_{mode}"] >= choices[f"last_first_token_s_{mode}"] > 0
