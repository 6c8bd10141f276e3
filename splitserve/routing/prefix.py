"""What a cached prefix is worth to a request: the one rule the router and the simulator share.

- `reusable`: of the prompt tokens a worker holds, those its engine reuses. vLLM computes at
  least the last prompt token, so at most the largest multiple of its block size below the
  prompt's length.
- `prefill_on_d`: whether a request runs whole on its D (no P leg, no transfer): D reuses part of
  the prompt and computes at most `max_tokens` of it (0 turns prefill on D off).
"""

from __future__ import annotations

# Prefill on D: a request whose chosen D holds all but at most this many prompt tokens runs
# whole on that D. 128 tokens (one vLLM-CPU block): such a prefill stalls D's other streams
# once, by ~0.1 s on the demo model (benchmarks/local_prefill_stall.py; docs/concepts/routing.md,
# "Prefill on D").
LOCAL_PREFILL_MAX_TOKENS = 128


def reusable(cached: int, prompt_len: int, block_size: int) -> int:
    """Of `cached` prompt tokens held, those the engine reuses for a prompt of `prompt_len`."""
    if prompt_len < 1 or block_size < 1:
        return 0
    return max(0, min(cached, (prompt_len - 1) // block_size * block_size))


def prefill_on_d(reused_on_d: int, prompt_len: int, max_tokens: int) -> bool:
    """Whether D, reusing `reused_on_d` tokens of the prompt, should compute the rest itself."""
    return max_tokens > 0 and reused_on_d > 0 and prompt_len - reused_on_d <= max_tokens
