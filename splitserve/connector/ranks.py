"""Which KV heads each tensor-parallel rank holds, and which pieces of a transfer go from which P
rank to which D rank.

vLLM shards K KV heads over t ranks as `QKVParallelLinear` does: with t <= K, rank r holds the
K/t heads [r·K/t, (r+1)·K/t); with t > K, rank r holds the one head r // (t/K), each head
replicated on t/K ranks. One of t and K divides the other. A latent (MLA) cache is one
"head" every rank holds whole.

A transfer moves each head once from P: a head is sent by the lowest P rank that holds it (its
*owner*), to every D rank that holds it. What one P rank sends one D rank is a *piece*: the
heads [lo, hi) both hold, in the staging format of those heads alone (`HeadSlice`). The pieces a
D rank receives tile the heads it holds. A piece that is the D rank's whole range keeps the
transfer's id; a strict part is named `piece_id` (`<transfer>@<lo>-<hi>`), so equal TP and a
single-rank D look exactly as they did without ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

HeadRange = tuple[int, int]  # [lo, hi) of the model's KV heads


def check_tp(total_kv_heads: int, tp: int, latent: bool = False) -> None:
    """ValueError unless `tp` ranks can shard `total_kv_heads` heads (vLLM's rule)."""
    if tp < 1:
        raise ValueError(f"tensor parallel size must be at least 1, got {tp}")
    if not latent and total_kv_heads % tp and tp % total_kv_heads:
        raise ValueError(f"tp {tp} cannot shard {total_kv_heads} KV heads: one of the two "
                         "must divide the other")


@dataclass(frozen=True)
class RankHeads:
    """One rank's place among `tp` ranks of a model with `total` KV heads (1 when `latent`)."""

    total: int
    tp: int = 1
    rank: int = 0
    latent: bool = False

    def __post_init__(self) -> None:
        check_tp(self.total, self.tp, self.latent)
        if not 0 <= self.rank < self.tp:
            raise ValueError(f"rank {self.rank} is not one of tp {self.tp}")
        if self.latent and self.total != 1:
            raise ValueError("a latent cache has one head")

    @classmethod
    def single(cls, kv_heads: int, latent: bool = False) -> RankHeads:
        """The one rank of an engine without tensor parallelism, holding `kv_heads` heads (or a
        latent cache)."""
        return cls(1 if latent else kv_heads, latent=latent)

    def of(self, rank: int, tp: int | None = None) -> RankHeads:
        """Another rank of the same model (of `tp` ranks; default this one's)."""
        return RankHeads(self.total, self.tp if tp is None else tp, rank, self.latent)

    @property
    def held(self) -> HeadRange:
        """The heads this rank's cache holds."""
        if self.latent:
            return (0, 1)
        if self.tp <= self.total:
            per = self.total // self.tp
            return (self.rank * per, (self.rank + 1) * per)
        head = self.rank // (self.tp // self.total)
        return (head, head + 1)

    @property
    def owned(self) -> HeadRange | None:
        """The heads this rank sends (it is their lowest holder); None: it sends nothing."""
        lo, _ = self.held
        first_holder = 0 if self.latent else (
            self.rank if self.tp <= self.total else lo * (self.tp // self.total))
        return self.held if self.rank == first_holder else None

    def pieces_to(self, d_tp: int) -> list[tuple[int, HeadRange]]:
        """As a P rank: (D rank, heads) for every piece this rank sends to a D of `d_tp` ranks."""
        owned = self.owned
        if owned is None:
            return []
        out = []
        for d in range(d_tp):
            heads = _overlap(owned, self.of(d, d_tp).held)
            if heads is not None:
                out.append((d, heads))
        return out

    def pieces_from(self, p_tp: int) -> list[HeadRange]:
        """As a D rank: the pieces a P of `p_tp` ranks sends this rank, in head order; they tile
        `held`."""
        out = []
        for r in range(p_tp):
            owned = self.of(r, p_tp).owned
            heads = _overlap(owned, self.held) if owned is not None else None
            if heads is not None:
                out.append(heads)
        return sorted(out)

    def staged_pieces(self, transfer_id: str, p_tp: int) -> list[tuple[str, HeadRange]]:
        """As a D rank: (staged id, heads) of every piece of a transfer from a P of `p_tp`
        ranks."""
        return [(self.piece_id(transfer_id, h), h) for h in self.pieces_from(p_tp)]

    def piece_id(self, transfer_id: str, heads: HeadRange) -> str:
        """As a D rank: the id under which the piece `heads` of a transfer is staged here."""
        return transfer_id if heads == self.held else f"{transfer_id}@{heads[0]}-{heads[1]}"

    def local(self, heads: HeadRange) -> HeadRange:
        """`heads` (within `held`) counted from this rank's first head."""
        lo, hi = self.held
        if not lo <= heads[0] < heads[1] <= hi:
            raise ValueError(f"heads {heads} are not all held by rank {self.rank} of tp "
                             f"{self.tp} (it holds {self.held})")
        return (heads[0] - lo, heads[1] - lo)


def transfer_of(staged_id: str) -> str:
    """The transfer a staged id belongs to (the id itself, or a piece's `<transfer>@lo-hi`)."""
    return staged_id.partition("@")[0]


def _overlap(a: HeadRange, b: HeadRange) -> HeadRange | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None
