"""The `multiturn` workload: chat sessions that resend their whole conversation every turn.

A session's turn k (0-based) sends

    system prompt + user(0) + answer(0) + … + user(k−1) + answer(k−1) + user(k)

where the system prompt (`system_tokens`) is the same for every session, user(j) is
`user_tokens` tokens of session s's turn j, and answer(j) is the token ids the server
*generated* for turn j (vLLM's `return_token_ids`; with `ignore_eos`, `output_tokens` of them).
All token ids come from generators seeded by (spec seed, part, session, turn), in the synthetic
range of workload.py, so a session's prompts are fixed by the seed and the server's answers.

Closed loop per session (`run_sessions`): session s starts at its arrival (the spec's arrival
process draws the session starts: `rate` is sessions per second; `max_concurrency` caps the
sessions in flight), sends turn 0, and sends turn k+1 `think_time_s` after turn k's response
ended. When a turn fails, the session's later turns are not sent and are recorded as failed
with cause `session` (an earlier turn of the session failed).

`build_stream` (the plan: what the run sheet's digest, `--spec-json` and the simulator see)
is the same sessions open-loop: turn k arrives at start + k × think time and its answers are
placeholders of `output_tokens` seeded tokens. The lengths are the run's when the server returns
`output_tokens` tokens a turn; the sent arrival times and answer tokens are the run's own.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import httpx
import numpy as np

from splitserve.bench.client import (
    ClientConfig,
    RequestRecord,
    http_client,
    new_record,
    resolve_model,
    send_one,
)
from splitserve.bench.repeat import IdealReuse, MultiturnOptions, ideal_reuse_tokens
from splitserve.bench.workload import _TOKEN_HIGH, _TOKEN_LOW, Request, WorkloadSpec

_SYSTEM, _USER, _PLACEHOLDER = 0x73797300, 0x75736572, 0x706C6163  # seed tags
FIRST_TURN, FOLLOW_UP = "first-turn", "follow-up"  # request kinds


def _tokens(entropy: list[int], n: int) -> tuple[int, ...]:
    rng = np.random.default_rng(entropy)
    return tuple(int(x) for x in rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=n))


def system_prompt(opts: MultiturnOptions, seed: int) -> tuple[int, ...]:
    return _tokens([seed, _SYSTEM], opts.system_tokens)


def user_tokens(opts: MultiturnOptions, seed: int, session: int, turn: int) -> tuple[int, ...]:
    return _tokens([seed, _USER, session, turn], opts.user_tokens)


def placeholder_answer(opts: MultiturnOptions, seed: int, session: int, turn: int
                       ) -> tuple[int, ...]:
    return _tokens([seed, _PLACEHOLDER, session, turn], opts.output_tokens)


def turn_prompt(opts: MultiturnOptions, seed: int, session: int, answers: Sequence[Sequence[int]]
                ) -> tuple[int, ...]:
    """The prompt of turn len(answers) of `session`, given the answers of its earlier turns."""
    out = list(system_prompt(opts, seed))
    for turn, answer in enumerate(answers):
        out += user_tokens(opts, seed, session, turn)
        out += answer
    out += user_tokens(opts, seed, session, len(answers))
    return tuple(out)


def build_multiturn(spec: WorkloadSpec) -> list[Request]:
    """The open-loop plan of a `multiturn` spec (see the module docstring), sorted by arrival;
    `index` is the position in that order."""
    opts = spec.multiturn
    rng = np.random.default_rng(spec.seed)
    starts = np.cumsum(spec.arrival.gaps(rng, opts.sessions))
    plan = []
    for s in range(opts.sessions):
        answers: list[tuple[int, ...]] = []
        for k in range(opts.turns):
            prompt = turn_prompt(opts, spec.seed, s, answers)
            plan.append((float(starts[s]) + k * opts.think_time_s, s, k, prompt))
            answers.append(placeholder_answer(opts, spec.seed, s, k))
    plan.sort(key=lambda p: (p[0], p[1], p[2]))
    return [Request(i, t, prompt, opts.output_tokens, kind=FIRST_TURN if k == 0 else FOLLOW_UP,
                    session=s, turn=k) for i, (t, s, k, prompt) in enumerate(plan)]


def _skipped(req: Request, at: float) -> RequestRecord:
    rec = new_record(req)
    rec.send_s = rec.end_s = at
    rec.error_cause, rec.error = "session", "an earlier turn of this session failed"
    return rec


async def run_sessions(cfg: ClientConfig, spec: WorkloadSpec, plan: list[Request],
                       on_done: Callable[[RequestRecord], None] | None = None,
                       transport: httpx.AsyncBaseTransport | None = None,
                       http: httpx.AsyncClient | None = None,
                       ) -> tuple[list[RequestRecord], float, IdealReuse]:
    """Run `plan`'s sessions closed-loop (see the module docstring).

    Returns the records in plan order (each turn's record keeps the answer's token ids; its
    prompt's too when `cfg.save_token_ids`), the run's duration in seconds (first session start
    to the last response's end), and the ideal reuse of the prompts sent, in send order.
    Over `http` when given (see `client.http_client`); `transport`: httpx's for a client of
    its own (tests script a server with it)."""
    if not cfg.vllm_extras:
        raise ValueError("the multiturn workload needs the answers' token ids: vLLM's "
                         "return_token_ids (do not pass --no-vllm-extras)")
    opts = spec.multiturn
    by_session: dict[int, list[Request]] = {}
    for r in plan:
        by_session.setdefault(int(r.session or 0), []).append(r)
    records: dict[int, RequestRecord] = {}
    sent: list[tuple[float, tuple[int, ...], list[int]]] = []
    cap = spec.arrival.max_concurrency
    sem = asyncio.Semaphore(cap) if cap else None
    async with http_client(cfg, http, transport) as client:
        model = await resolve_model(client, cfg)
        t0 = time.perf_counter()

        async def turns(reqs: list[Request]) -> None:
            answers: list[list[int]] = []
            due = reqs[0].arrival_s
            for k, planned in enumerate(reqs):
                if k and not records[reqs[k - 1].index].ok:
                    records[planned.index] = _skipped(planned, time.perf_counter() - t0)
                    if on_done is not None:
                        on_done(records[planned.index])
                    continue
                delay = due - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                prompt = turn_prompt(opts, spec.seed, int(planned.session or 0), answers)
                req = Request(planned.index, due, prompt, planned.output_len, kind=planned.kind,
                              session=planned.session, turn=planned.turn)
                rec = new_record(req, keep_output=True, keep_prompt=cfg.save_token_ids)
                await send_one(client, cfg, model, req, rec, t0)
                if rec.ok and len(rec.output_token_ids or []) != rec.output_tokens:
                    rec.error_cause = "no_token_ids"  # the next turn would lack the answer
                    rec.error = "the answer came without its token ids (vLLM's return_token_ids)"
                records[req.index] = rec
                if rec.ok:
                    answer = list(rec.output_token_ids or [])
                    answers.append(answer)
                    sent.append((rec.send_s, prompt, answer))
                if on_done is not None:
                    on_done(rec)
                due = rec.end_s + opts.think_time_s

        async def session(reqs: list[Request]) -> None:
            delay = reqs[0].arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await turns(reqs)
            else:
                async with sem:
                    await turns(reqs)

        await asyncio.gather(*(session(sorted(rs, key=lambda r: r.turn or 0))
                               for rs in by_session.values()))
        duration = time.perf_counter() - t0
    ideal = ideal_reuse_tokens((p, a) for _, p, a in sorted(sent, key=lambda x: x[0]))
    return [records[r.index] for r in plan], duration, ideal
