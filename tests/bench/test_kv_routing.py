"""The KV routing simulation, tiny: conversations resend their growing history, and the
printed hit-rate lines parse."""

from __future__ import annotations

import re

from bench.kv_routing import Workload, main


def test_each_turn_resends_its_conversations_history():
    turns = Workload(num_conversations=3, num_turns=3, system_tokens=32).turns()
    assert len(turns) == 9
    history: dict[int, list[int]] = {}
    for turn in turns:
        previous = history.get(turn.conversation)
        if previous is None:
            assert turn.prompt[:32] == turns[0].prompt[:32]  # the shared system prompt
        else:
            assert turn.prompt[: len(previous)] == previous
        assert 40 <= len(turn.prompt) - len(previous or turn.prompt[:32]) <= 160
        history[turn.conversation] = turn.prompt + turn.answer


def test_tiny_run_prints_the_hit_rate_lines(capsys):
    main(
        [
            *("--conversations", "6", "--turns", "3", "--system-tokens", "64"),
            *("--blocks-per-shard", "128", "--concurrency", "4", "--heartbeat-every", "2"),
        ]
    )
    out = capsys.readouterr().out
    rates = re.search(
        r"^prefix hit rate: prefix routing (\d\.\d{3}), load routing (\d\.\d{3}), "
        r"one giant shard (\d\.\d{3})$",
        out,
        re.MULTILINE,
    )
    ratio = re.search(r"^prefix routing / giant shard: (\d+\.\d{2})$", out, re.MULTILINE)
    assert rates is not None and ratio is not None, out
    assert all(0 < float(r) < 1 for r in rates.groups())
