"""Block keys: one 64-bit key per full block of a token sequence, chained over the prefix.

Contract: `prefix_keys(ids, block_size)[i]` is a function of `ids[: (i + 1) * block_size]` and
nothing else (xxh3-64 of the previous key and the block's token ids as little-endian int64),
so equal keys at the same position mean equal prefixes up to a 2^-64 collision. A partial last
block has no key: vLLM caches full blocks only. The worker keys the blocks its engine reports
stored; the router keys a prompt; `matched_tokens` is how much of a prompt a worker holds.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

import numpy as np
import xxhash

ROOT_KEY = 0  # the parent key of a sequence's first block
KEY_BYTES = 8


def block_key(parent: int, block: Sequence[int]) -> int:
    """The key of one full block whose prefix ends in the block keyed `parent`."""
    h = xxhash.xxh3_64(parent.to_bytes(KEY_BYTES, "little"))
    h.update(np.asarray(block, dtype="<i8").tobytes())
    return h.intdigest()


def prefix_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The keys of every full block of `token_ids`, chained from `parent`."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


def matched_tokens(keys: Sequence[int], held: Container[int], block_size: int) -> int:
    """Tokens of the prompt keyed `keys` that a cache holding `held` has: its longest run of
    held blocks from the first (a prefix cache reuses nothing after the first miss)."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n * block_size
