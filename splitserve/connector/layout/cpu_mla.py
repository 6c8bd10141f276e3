"""vLLM-CPU's latent (MLA) cache: DeepSeek-V2/V3-style attention on the CPU MLA backend.

One tensor per layer, `[num_blocks, block_size, W]` (or with a unit heads axis,
`[num_blocks, 1, block_size, W]`), contiguous: slot s of block b holds one latent row of W
elements (the compressed KV, `kv_lora_rank`, then the rope key, `qk_rope_head_dim`) at row
`b * block_size + s` of the tensor seen as `[rows, W]`. Staged as `[n, W]` rows
(`staging_format`, latent). (The latent is the same on every TP rank; the connector runs TP 1.)
`verify` checks this against the backend's own cache write at start-up.
"""

from __future__ import annotations

import torch

from splitserve.connector.layout.cpu import block_runs, consecutive
from splitserve.connector.layout.paged import EngineKV, PagedLayout, UnsupportedKVCache
from splitserve.connector.layout.staging_format import BlockIds

BACKEND = "CPU_MLA"


def latent_rows(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The cache as `[num_blocks * block_size, W]` rows, and its block size."""
    if kv_cache.dim() == 4 and kv_cache.shape[1] == 1:
        kv_cache = kv_cache.squeeze(1)
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        raise ValueError(f"unexpected latent KV layout {tuple(kv_cache.shape)}")
    nb, bs, width = kv_cache.shape
    return kv_cache.view(nb * bs, width), bs


def _gather_whole_blocks(paged_rows: torch.Tensor, block_size: int, block_ids: BlockIds,
                         rows: torch.Tensor) -> None:
    """Whole blocks `block_ids` of `paged_rows` (`[num_blocks * block_size, W]`) into the
    contiguous `rows` (`[len(block_ids) * block_size, W]`), in one `index_select`."""
    width = paged_rows.shape[1]
    torch.index_select(paged_rows.view(-1, block_size * width), 0,
                       torch.tensor(block_ids, dtype=torch.int64),
                       out=rows.view(len(block_ids), block_size * width))


class VllmCpuMlaLayout(PagedLayout):
    """One layer of vLLM-CPU's latent cache (see the module docstring)."""

    name = "vLLM-CPU MLA"
    latent = True

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self._rows, self._block_size = latent_rows(kv_cache)
        self._width = self._rows.shape[1]
        self._dtype = kv_cache.dtype
        self._ptr = kv_cache.data_ptr()

    @classmethod
    def recognises(cls, kv_cache: torch.Tensor, engine: EngineKV) -> bool:
        shape = tuple(kv_cache.shape)
        return (engine.device == "cpu" and kv_cache.device.type == "cpu"
                and engine.latent
                and all(b == BACKEND for b in engine.backends)
                and (len(shape) == 3 or (len(shape) == 4 and shape[1] == 1))
                and kv_cache.is_contiguous() and kv_cache.dtype.is_floating_point)

    @classmethod
    def expects(cls) -> str:
        return (f"{cls.name}: one contiguous CPU tensor per layer, [num_blocks, block_size, "
                f"latent], attention backend {BACKEND} (on a CPU with AMX vLLM picks AMX_MLA: "
                f"pass --attention-backend {BACKEND} to vLLM after --)")

    @classmethod
    def verify(cls, kv_cache: torch.Tensor, engine: EngineKV) -> None:
        """Check `gather` against the CPU MLA backend's cache write on a two-block scratch."""
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

        rows, bs = latent_rows(torch.zeros((2, *kv_cache.shape[1:]), dtype=kv_cache.dtype))
        width = rows.shape[1]
        scratch = rows.view(2, bs, width)
        n = min(5, bs)
        latent = (torch.arange(n * width, dtype=torch.float32).view(n, width) + 1
                  ).to(kv_cache.dtype)
        # the backend writes the compressed KV and the rope key side by side in each row
        half = width // 2
        CPUMLAImpl.do_kv_cache_update(None, latent[:, :half],
                                      latent[:, None, half:], scratch, torch.arange(bs, bs + n),
                                      "auto", torch.ones(()))
        layout = cls(scratch)
        region = torch.empty(n * layout.bytes_per_token, dtype=torch.uint8)
        layout.gather([0, 1], bs, bs + n, region)
        if not torch.equal(region.view(kv_cache.dtype).view(n, width), latent):
            raise UnsupportedKVCache(
                f"vLLM's CPU MLA cache (dtype {kv_cache.dtype}) is not the layout splitserve's "
                "connector reads; use the pinned vLLM release")

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self._width

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def holds(self, kv_layer: torch.Tensor) -> bool:
        return kv_layer.data_ptr() == self._ptr

    def _copy(self, block_ids: BlockIds, start: int, end: int, rows: torch.Tensor, base: int,
              to_paged: bool) -> None:
        """Tokens [start, end) between the blocks and `rows` (`[n, W]`, from token `base`).
        Out of the blocks, two or more whole blocks that are not consecutive move in one
        `index_select`, as in `cpu.copy_tokens`; otherwise one copy per run of consecutive
        blocks and per partial block."""
        bs = self._block_size
        first, last = -(-start // bs), end // bs  # the whole blocks: [first, last)
        if not to_paged and last - first >= 2 and not consecutive(block_ids[first:last]):
            r = first * bs - base
            _gather_whole_blocks(self._rows, bs, block_ids[first:last],
                                 rows[r:r + (last - first) * bs])
            if start < first * bs:
                self._copy(block_ids, start, first * bs, rows, base, to_paged)
            if last * bs < end:
                self._copy(block_ids, last * bs, end, rows, base, to_paged)
            return
        for block, _, off, t, n in block_runs(block_ids, bs, start, end):
            paged = self._rows[block * bs + off:block * bs + off + n]
            staged = rows[t - base:t - base + n]
            (paged if to_paged else staged).copy_(staged if to_paged else paged)

    def gather(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor) -> None:
        rows = region.view(self._dtype).view(end - start, self._width)
        self._copy(block_ids, start, end, rows, start, to_paged=False)

    def scatter(self, block_ids: BlockIds, start: int, end: int, region: torch.Tensor,
                region_start: int) -> None:
        rows = region.view(self._dtype).view(end - region_start, self._width)
        self._copy(block_ids, start, end, rows, region_start, to_paged=True)
