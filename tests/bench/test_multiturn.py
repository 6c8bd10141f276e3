"""The multiturn workload against a scripted server: each turn resends the history with the
answer the server generated; the plan; and the cache figures the servers report."""

from __future__ import annotations

import json

import httpx
import pytest

from splitserve.bench.cachestats import parse_prompt_sources, prefix_cache_stats, source_deltas
from splitserve.bench.client import ClientConfig, RequestRecord, _absorb_chunk
from splitserve.bench.multiturn import (
    FIRST_TURN,
    FOLLOW_UP,
    build_multiturn,
    run_sessions,
    system_prompt,
    turn_prompt,
    user_tokens,
)
from splitserve.bench.repeat import MultiturnOptions, ideal_reuse_tokens
from splitserve.bench.workload import ArrivalSpec, Request, WorkloadSpec, build_stream

OPTS = MultiturnOptions(sessions=3, turns=3, system_tokens=12, user_tokens=5, output_tokens=4,
                        think_time_s=0.05)
SPEC = WorkloadSpec(source="multiturn", multiturn=OPTS, arrival=ArrivalSpec("poisson", 50.0),
                    seed=7, warmup=1)


def scripted_answer(prompt: list[int], n: int) -> list[int]:
    """What the scripted server generates: a function of the whole prompt."""
    return [10 + (sum(prompt) * (i + 3) + len(prompt)) % 480 for i in range(n)]


def test_turn_prompt_is_the_history_plus_new_user_tokens() -> None:
    answers: list[list[int]] = []
    prompts = []
    for _ in range(OPTS.turns):
        prompts.append(list(turn_prompt(OPTS, 7, 1, answers)))
        answers.append(scripted_answer(prompts[-1], OPTS.output_tokens))
    sys_ = list(system_prompt(OPTS, 7))
    assert prompts[0] == sys_ + list(user_tokens(OPTS, 7, 1, 0))
    for k in range(1, OPTS.turns):
        assert prompts[k] == prompts[k - 1] + answers[k - 1] + list(user_tokens(OPTS, 7, 1, k))
    other = turn_prompt(OPTS, 7, 2, [])
    assert list(other[:12]) == sys_ and other[12:] != tuple(prompts[0][12:])  # shared system
    assert turn_prompt(OPTS, 8, 1, []) != tuple(prompts[0])  # the seed fixes the tokens


def test_the_plan_is_deterministic_open_loop() -> None:
    plan = build_stream(SPEC)
    assert plan == build_multiturn(SPEC) and len(plan) == 9
    assert [r.index for r in plan] == list(range(9))
    assert [r.arrival_s for r in plan] == sorted(r.arrival_s for r in plan)
    for s in range(3):
        mine = sorted((r for r in plan if r.session == s), key=lambda r: r.turn or 0)
        assert [r.turn for r in mine] == [0, 1, 2]
        assert [r.kind for r in mine] == [FIRST_TURN, FOLLOW_UP, FOLLOW_UP]
        assert [r.input_len for r in mine] == [17, 26, 35]  # + answer (4) + user (5) a turn
        assert mine[1].arrival_s - mine[0].arrival_s == pytest.approx(0.05)
        assert mine[2].prompt_token_ids[:26] == mine[1].prompt_token_ids


def server(fail: tuple[int, int] | None = None, token_ids: bool = True
           ) -> tuple[httpx.MockTransport, list[list[int]]]:
    """A scripted vLLM: streams `scripted_answer` token by token with the usage (cached tokens:
    the longest prefix of an earlier prompt + answer); a prompt of `fail` = (its first token
    after the system prompt, its length) is answered 503. `token_ids=False`: a server that
    ignores `return_token_ids` (text only)."""
    seen: list[list[int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        body = json.loads(request.content)
        prompt, n = body["prompt"], body["max_tokens"]
        assert body["return_token_ids"] and body["ignore_eos"]
        if fail is not None and len(prompt) == fail[1] and prompt[12] == fail[0]:
            return httpx.Response(503, text="overloaded")
        cached = max((next((i for i, (a, b) in enumerate(zip(p, prompt, strict=False))
                            if a != b), min(len(p), len(prompt))) for p in seen), default=0)
        answer = scripted_answer(prompt, n)
        seen.append(prompt + answer)
        events = [{"choices": [{"text": "x"} | ({"token_ids": [t]} if token_ids else {})]}
                  for t in answer]
        events.append({"choices": [], "usage": {"prompt_tokens": len(prompt),
                                                "completion_tokens": n,
                                                "prompt_tokens_details": {"cached_tokens":
                                                                          cached}}})
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode())

    return httpx.MockTransport(handler), seen


async def test_sessions_resend_the_answers_the_server_generated() -> None:
    transport, seen = server()
    cfg = ClientConfig("http://server", save_token_ids=True)
    plan = build_stream(SPEC)
    records, duration, ideal = await run_sessions(cfg, SPEC, plan, transport=transport)
    assert duration > 0 and len(seen) == 9 and all(r.ok for r in records)
    for s in range(3):
        mine = sorted((r for r in records if r.session == s), key=lambda r: r.turn or 0)
        for prev, cur in zip(mine, mine[1:], strict=False):
            assert prev.prompt_token_ids is not None and cur.prompt_token_ids is not None
            assert prev.output_token_ids == scripted_answer(prev.prompt_token_ids, 4)
            head = prev.prompt_token_ids + prev.output_token_ids
            assert cur.prompt_token_ids[:len(head)] == head
            assert cur.send_s >= prev.end_s + 0.05 - 1e-3  # after the think time
            assert cur.cached_tokens == len(head)  # the scripted cache saw the history
    # Ideal reuse: the first request reuses nothing, every other first turn the system prompt,
    # every follow-up its whole history (previous prompt + answer).
    follow = sum(len(r.prompt_token_ids or []) - OPTS.user_tokens for r in records if r.turn)
    assert (ideal.prompt_tokens, ideal.reused_tokens) == (
        sum(r.input_len for r in records), 2 * OPTS.system_tokens + follow)
    sent = sorted(records, key=lambda r: r.send_s)
    assert ideal == ideal_reuse_tokens((r.prompt_token_ids or [], r.output_token_ids or [])
                                       for r in sent)


async def test_a_failed_turn_ends_its_session() -> None:
    plan = build_stream(SPEC)
    victim = next(r for r in plan if r.session == 1 and r.turn == 1)
    transport, _ = server(fail=(victim.prompt_token_ids[12], victim.input_len))
    done: list[RequestRecord] = []
    records, _, _ = await run_sessions(ClientConfig("http://server"), SPEC, plan,
                                       done.append, transport=transport)
    assert sorted(r.index for r in done) == list(range(9))  # the progress bar ends
    by = {(r.session, r.turn): r for r in records}
    assert by[1, 1].error_cause == "http_503" and by[1, 2].error_cause == "session"
    assert by[1, 0].ok and all(by[s, k].ok for s in (0, 2) for k in range(3))
    assert by[0, 0].prompt_token_ids is None  # prompts are kept only when asked for
    with pytest.raises(ValueError, match="token ids"):
        await run_sessions(ClientConfig("http://server", vllm_extras=False), SPEC, plan,
                           transport=transport)


async def test_an_answer_without_its_token_ids_fails_and_ends_its_session() -> None:
    """The next turn must carry the answer: one that came as text only is a failed turn, not a
    follow-up sent without it."""
    transport, seen = server(token_ids=False)
    records, _, _ = await run_sessions(ClientConfig("http://server"), SPEC, build_stream(SPEC),
                                       transport=transport)
    assert len(seen) == 3  # each session's first turn; none went on
    assert sorted(r.error_cause or "" for r in records) == ["no_token_ids"] * 3 + ["session"] * 6


def test_cache_figures_the_servers_report() -> None:
    rec = RequestRecord(index=0, kind="normal", input_len=100, requested_output_len=2,
                        scheduled_s=0.0, output_token_ids=[])
    _absorb_chunk(rec, {"choices": [{"text": "a", "token_ids": [5, 6]}]}, 0.1)
    _absorb_chunk(rec, {"choices": [], "usage": {"completion_tokens": 2,
                                                 "prompt_tokens_details": {"cached_tokens": 64}}},
                  0.2)
    assert rec.output_token_ids == [5, 6] and rec.cached_tokens == 64
    silent = RequestRecord(index=1, kind="normal", input_len=50, requested_output_len=2,
                           scheduled_s=0.0, chunk_times=[0.1], chunk_tokens=[1])
    assert prefix_cache_stats([silent])["prefix_hit_rate"] is None
    told = RequestRecord(index=2, kind="normal", input_len=60, requested_output_len=2,
                         scheduled_s=0.0, chunk_times=[0.1], chunk_tokens=[1], cached_tokens=32)
    assert prefix_cache_stats([rec, silent, told]) == {
        "cache_reported_requests": 2, "cached_prompt_tokens": 96,
        "computed_prompt_tokens": 64, "prefix_hit_rate": 0.6}
    page = ('vllm:prompt_tokens_by_source_total{engine="0",model_name="m",source="local_compute"}'
            ' 120.0\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
            'source="local_cache_hit"} 64.0\n'
            'vllm:prompt_tokens_by_source_created{engine="0",model_name="m",'
            'source="local_cache_hit"} 1.7e9\n'
            'vllm:prompt_tokens_by_source_total{engine="0",model_name="m",'
            'source="external_kv_transfer"} 16.0\n')
    after = parse_prompt_sources(page)
    assert after == {"computed": 120.0, "cache_hit": 64.0, "loaded": 16.0}
    before = {"w": {"computed": 20.0, "cache_hit": 0.0, "loaded": 0.0}}
    assert source_deltas(before, {"w": after, "new": after}) == {
        "w": {"computed": 100.0, "cache_hit": 64.0, "loaded": 16.0, "hit_rate": 64 / 180}}
    from splitserve.bench.report import table_rows

    result = prefix_cache_stats([rec, told]) | {"ideal_reuse": 0.75, "prompt_tokens_by_source":
                                                source_deltas(before, {"w": after})}
    rows = {row[0]: row[1] for row in table_rows({"a": result})}
    assert rows["ideal reuse (workload: unbounded single cache)"] == "0.750"
    assert rows["prefix hit rate (server-reported)"] == "0.600"
    assert rows["prompt tokens computed / cache-hit / loaded (per worker)"] == "100 / 64 / 16"


def test_a_multiturn_rate_counts_session_starts_where_it_is_reported() -> None:
    from splitserve.bench.report import table_rows

    assert SPEC.rate_unit == "sessions/s" and WorkloadSpec().rate_unit == "req/s"
    swept = {"mt": {"distserve_goodput": 0.5, "sweep": {"rate_unit": "sessions/s"}},
             "syn": {"distserve_goodput": 4.0, "sweep": {"rate_unit": "req/s"}},
             "one": {}}
    rows = {row[0]: row[1:] for row in table_rows(swept)}
    assert rows["DistServe goodput"] == ["0.500 sessions/s", "4.000 req/s", "–"]


def test_requests_carry_their_session() -> None:
    r = Request(0, 0.0, (1, 2), 3, session=4, turn=1)
    from splitserve.bench.client import new_record

    rec = new_record(r, keep_output=True)
    assert (rec.session, rec.turn, rec.output_token_ids, rec.prompt_token_ids) == (4, 1, [], None)
    assert RequestRecord.from_dict(rec.to_dict()) == rec
