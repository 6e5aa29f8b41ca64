"""`cascadia bench turns` on the tiny model: both modes run, and the kept one takes over the history."""

from __future__ import annotations

import json

from rich.console import Console

from cascadia.bench.turns import TurnsBenchConfig, conversation_turns, run_turns_bench


def test_a_conversation_takes_over_its_history_only_where_finished_streams_are_kept(tiny, tmp_path):
    config = TurnsBenchConfig(tiny, tmp_path, shards=2, turns=3, repeats=1, answer_tokens=4, opening_repeats=1)
    summary = run_turns_bench(config, Console(quiet=True))
    assert json.loads((tmp_path / "turns.json").read_text()) == summary
    assert (tmp_path / "turns.png").stat().st_size > 0
    first, *later = summary["turns"]
    assert first["cached_tokens"] == 0
    for before, turn in zip(summary["turns"], later, strict=False):
        # the last turn's prompt at least: its answer too, as far as the history spells it the same
        assert before["prompt_tokens"] <= turn["cached_tokens"] < turn["prompt_tokens"]
    assert len(conversation_turns(3, 1)) == 3
