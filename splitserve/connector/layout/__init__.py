"""Where the connector meets the engine's KV cache.

- `staging_format`: the layout of KV bytes in flight (`KVShape`, `region_offset`,
  `chunk_views`), the same for every engine cache layout.
- `paged`: the `PagedLayout` interface (one layer of the engine's paged cache: gather a token
  range into the staging format, scatter it back, verify against the engine at start-up), the
  engine facts it is chosen from (`EngineKV`) and the start-up refusal (`UnsupportedKVCache`).
- `cpu`: vLLM-CPU's paged layout.
- `cuda`: vLLM's standard-attention layouts on CUDA (FlashAttention, FlashInfer, Triton), whose
  copies `strided` does in device-agnostic torch (it imports only torch).
- `select`: the factory that picks the implementation for an engine's caches, or refuses them.
"""
