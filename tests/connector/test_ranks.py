"""Tensor-parallel ranks: which heads each rank holds and sends (`connector.ranks`, checked
against vLLM's own sharding rule), and `HeadSlice`, which copies a piece of a rank's heads in
and out of a vLLM-CPU paged cache: P's pieces, scattered into D's ranks, rebuild P's cache."""

from __future__ import annotations

import pytest
import torch

from splitserve.connector.layout.cpu import VllmCpuLayout, paged_kv
from splitserve.connector.layout.head_slice import HeadSlice
from splitserve.connector.protocol import Fingerprint
from splitserve.connector.ranks import RankHeads, check_tp, transfer_of


def vllm_kv_heads(total: int, tp: int, rank: int) -> tuple[int, int]:
    """vLLM 0.32's `QKVParallelLinear`: the KV heads a rank's weights (so its cache) hold."""
    if tp >= total:
        replicas = tp // total
        return (rank // replicas, rank // replicas + 1)
    per = total // tp
    return (rank * per, (rank + 1) * per)


@pytest.mark.parametrize(("total", "tp"), [(4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (8, 2)])
def test_held_heads_follow_vllm_sharding(total: int, tp: int) -> None:
    for r in range(tp):
        assert RankHeads(total, tp, r).held == vllm_kv_heads(total, tp, r)


@pytest.mark.parametrize(("total", "p_tp", "d_tp"),
                         [(4, 2, 1), (4, 1, 2), (4, 2, 2), (1, 2, 1), (1, 1, 2), (2, 4, 1),
                          (8, 4, 2), (2, 1, 4)])
def test_each_head_reaches_each_d_rank_that_holds_it_once(total: int, p_tp: int,
                                                          d_tp: int) -> None:
    sent: dict[int, list[tuple[int, int]]] = {d: [] for d in range(d_tp)}
    for r in range(p_tp):
        for d, heads in RankHeads(total, p_tp, r).pieces_to(d_tp):
            sent[d].append(heads)
    for d in range(d_tp):
        rank = RankHeads(total, d_tp, d)
        assert sorted(sent[d]) == rank.pieces_from(p_tp)
        covered = [h for lo, hi in sent[d] for h in range(lo, hi)]
        assert covered == list(range(*rank.held))  # tiled, nothing twice


def test_piece_ids_and_replicas() -> None:
    d = RankHeads(4, 1, 0)
    assert d.pieces_from(2) == [(0, 2), (2, 4)]
    assert [d.piece_id("t", h) for h in d.pieces_from(2)] == ["t@0-2", "t@2-4"]
    assert transfer_of("t@2-4") == "t" and transfer_of("t") == "t"
    assert RankHeads(4, 2, 1).pieces_to(1) == [(0, (2, 4))]
    assert RankHeads(4, 1, 0).pieces_to(2) == [(0, (0, 2)), (1, (2, 4))]
    assert RankHeads(4, 2, 1).piece_id("t", (2, 4)) == "t"  # a rank's whole range: the id
    one_head = [RankHeads(1, 2, r) for r in range(2)]
    assert [r.owned for r in one_head] == [(0, 1), None]  # the replica sends nothing
    assert one_head[1].pieces_to(1) == []
    mla = [RankHeads(1, 2, r, latent=True) for r in range(2)]
    assert [m.pieces_to(2) for m in mla] == [[(0, (0, 1)), (1, (0, 1))], []]


def test_unmappable_tp_is_refused_naming_both() -> None:
    with pytest.raises(ValueError, match="tp 3 cannot shard 4 KV heads"):
        check_tp(4, 3)
    d = Fingerprint("h", "float32", 2, 4, 64, "0.32.0", tp_size=2)
    assert d.mismatch(Fingerprint("h", "float32", 2, 4, 64, "0.32.0", tp_size=4)) is None
    problem = d.mismatch(Fingerprint("h", "float32", 2, 4, 64, "0.32.0", tp_size=3))
    assert problem is not None and "decode tp 2 and prefill tp 3" in problem
    assert "num_kv_heads" in (d.mismatch(Fingerprint("h", "float32", 2, 2, 64, "0.32.0",
                                                     tp_size=2)) or "")


def test_head_slices_carry_p_heads_into_d_ranks() -> None:
    """P tp1 (4 heads) -> D tp2 (2 heads a rank) and back (D tp1 from P tp2's two pieces)."""
    torch.manual_seed(0)
    block, dim = 16, 8
    p_cache = torch.randn(6, 4, block, 2 * dim)
    p = VllmCpuLayout(p_cache)
    p_ids, start, end = [4, 1, 5], 3, 41
    d_ranks = [VllmCpuLayout(torch.zeros(5, 2, block, 2 * dim)) for _ in range(2)]
    d_ids = [2, 0, 3]
    for d, (_, (lo, hi)) in enumerate(RankHeads(4, 1, 0).pieces_to(2)):
        piece = torch.empty((end - start) * 2 * (hi - lo) * dim * 4, dtype=torch.uint8)
        HeadSlice(p, lo, hi).gather(p_ids, start, end, piece)
        d_ranks[d].scatter(d_ids, start, end, piece, start)  # the D rank's whole range
    whole = torch.zeros(7, 4, block, 2 * dim)
    back = VllmCpuLayout(whole)
    w_ids = [6, 3, 0]
    for d, layout in enumerate(d_ranks):  # each rank as a P of tp 2 sends its heads whole
        piece = torch.empty((end - start) * 2 * 2 * dim * 4, dtype=torch.uint8)
        layout.gather(d_ids, start, end, piece)
        HeadSlice(back, 2 * d, 2 * d + 2).scatter(w_ids, start + 5, end, piece, start)
    (kp, vp), (kw, vw) = paged_kv(p_cache), paged_kv(whole)
    for t in range(start + 5, end):
        (bp, op), (bw, ow) = divmod(t, block), divmod(t, block)
        assert torch.equal(kw[w_ids[bw], :, :, ow], kp[p_ids[bp], :, :, op])
        assert torch.equal(vw[w_ids[bw], :, ow], vp[p_ids[bp], :, op])
    # the tokens before the scatter's start are left as they were
    assert not kw[w_ids[0], :, :, :start + 5].any() and not vw[w_ids[0], :, :start + 5].any()
