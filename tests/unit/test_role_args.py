"""Each role's command line as the operator, the local fleet and `cascadia up` build it: every flag it
writes is one the real command parses, with the value it was given; bad combinations are refused with
the flags named."""

from __future__ import annotations

import click
import pytest
import typer.main

from cascadia.cli import app
from cascadia.role_args import ConvertArgs, DraftArgs, GatewayArgs, RouterArgs, ShardArgs

EXAMPLES = [
    ShardArgs("/m", (6, 12), "0.0.0.0:7000", 1, "int4", "GPU", 4096, 88, next="s2:7000", kv_precision="u8"),
    ShardArgs("/m", (60, 66), "127.0.0.1:1", 10, "w4a8", reply_to="r:7100", mtp_depths=2, threads=2),
    ConvertArgs("/m", "/cache/x", (0, 6), "w8a8", "GPU"),
    RouterArgs(
        "0.0.0.0:7100", ("s0:7000", "s1:7000"), "0.0.0.0:7101", rows_per_group=8, prefill_window=8,
        max_streams=176, max_queue=10, keep_finished=0, min_shared_prefix=32, frames_in_flight=1,
        draft_rows=16, max_draft=5, draft="d:7200", mtp_draft=2,
    ),
    GatewayArgs("r:7100", "/m", "0.0.0.0", 8000, 4096, 4, __file__, "redis://x:6379/0", 600),  # a keys file that exists
    DraftArgs("0.0.0.0:7200", "redis://x:6379/0", 0.5, "/draft", "/m"),
]  # fmt: skip


def _parsed(argv: list[str]) -> tuple[click.Command, dict]:
    group = typer.main.get_command(app)
    command = group.get_command(group.make_context("cascadia", [argv[0]]), argv[0])
    assert command is not None, f"no subcommand '{argv[0]}'"
    return command, command.make_context(argv[0], list(argv[1:])).params


@pytest.mark.parametrize("args", EXAMPLES, ids=lambda a: a.command)
def test_every_flag_a_role_line_writes_is_parsed_by_its_command_with_its_value(args):
    argv = args.to_argv()
    command, params = _parsed(argv)
    by_flag = {opt: p.name for p in command.params for opt in p.opts}
    given = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert len(given) == sum(v is not None for v in vars(args).values())
    for flag, text in given.items():
        assert str(params[by_flag[flag]]) == text, flag


def test_a_field_left_unset_is_not_passed_and_the_command_keeps_its_default():
    argv = ShardArgs("/m", (0, 2), "a:1", 0, "f32", reply_to="r:2").to_argv()
    assert "--context" not in argv and "--device" not in argv
    _, params = _parsed(argv)
    assert params["device"] == "CPU" and params["context"] is None


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ShardArgs("/m", (0, 2), "a:1", 0, "f32"), "give exactly one of --next and --reply-to"),
        (lambda: ShardArgs("/m", (0, 2), "a:1", 0, "f32", next="b", reply_to="c"), "exactly one of"),
        (lambda: ShardArgs("/m", (2, 2), "a:1", 0, "f32", next="b"), "--layers 2:2: expected 0 <= A < B"),
        (lambda: ShardArgs("/m", (0, 2), "a:1", 0, "int3", next="b"), "--precision 'int3' is not one of"),
        (lambda: ShardArgs("/m", (0, 2), "a:1", 0, "f32", next="b", mtp_depths=2), "--mtp-depths is for the last"),
        (lambda: ConvertArgs("/m", "/o", (3, 1), "int4"), "--layers 3:1"),
        (lambda: RouterArgs("a:1", (), "c:2"), "--stages is empty"),
        (lambda: RouterArgs("a:1", ("s",), "c:2", rows_per_group=4, max_draft=4), "--max-draft 4 must be below"),
        (lambda: RouterArgs("a:1", ("s",), "c:2", mtp_draft=2), "give --max-draft too"),
        (lambda: DraftArgs("a:1", model="/d"), "--model needs --target"),
    ],
)
def test_a_bad_combination_is_refused_naming_the_flags(build, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build()
