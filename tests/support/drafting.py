"""Speculative decoding in the tests: the n-gram drafting config the speculative tests give D
(over splitserve's connector and over NIXL), and vLLM's draft counters they read from D."""

from __future__ import annotations

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
