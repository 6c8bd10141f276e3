"""`splitserve bench --workload multiturn` against the package's plain vLLM worker: every turn
resends the previous prompt and the answer the server generated, and the result reports the
cache figures the server gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.cli import main
from tests.support.workers import TOKEN, Worker

SYSTEM, USER, OUTPUT = 256, 16, 8  # vLLM-CPU caches whole 128-token blocks


@pytest.mark.integration
def test_multiturn_resends_the_generated_answers(plain_worker: Worker, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPLITSERVE_API_KEY", TOKEN)
    monkeypatch.setenv("SPLITSERVE_TOKEN", TOKEN)
    out = tmp_path / "mt.json"
    assert main(["bench", "--url", plain_worker.url, "--result-json", str(out), "--workload",
                 "multiturn", "--sessions", "2", "--turns", "3", "--system-prompt-tokens",
                 str(SYSTEM), "--user-tokens", str(USER), "--turn-output-tokens", str(OUTPUT),
                 "--think-time", "0.2", "--session-rate", "4", "--warmup", "1",
                 "--save-token-ids"]) == 0
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (6, 0)
    reqs = res["requests"]
    for s in (0, 1):
        turns = sorted((r for r in reqs if r["session"] == s), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [0, 1, 2]
        assert len(turns[0]["prompt_token_ids"]) == SYSTEM + USER
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert len(prev["output_token_ids"]) == OUTPUT
            head = prev["prompt_token_ids"] + prev["output_token_ids"]
            assert cur["prompt_token_ids"][:len(head)] == head
            assert len(cur["prompt_token_ids"]) == len(head) + USER
            assert cur["input_len"] == len(cur["prompt_token_ids"])
            # the worker held the conversation's whole blocks: at least the system prompt's
            assert cur["cached_tokens"] >= SYSTEM
    assert res["cache_reported_requests"] == 6 and res["prefix_hit_rate"] > 0.3
    assert res["ideal_reuse"] > res["prefix_hit_rate"] * 0.9
    assert res["cached_prompt_tokens"] + res["computed_prompt_tokens"] == sum(
        r["input_len"] for r in reqs)
    (sources,) = res["prompt_tokens_by_source"].values()
    assert sources["cache_hit"] >= res["cached_prompt_tokens"] and sources["computed"] > 0
    assert res["run_sheet"]["workload"]["multiturn"]["turns"] == 3
