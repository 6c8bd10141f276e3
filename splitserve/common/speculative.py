"""Speculative decoding on D: vLLM's `--speculative-config`, validated for a worker's role.

Drafting makes decode steps emit several tokens; it never changes which tokens (greedy output is
exact: drafts are verified by the target model). Where it may run:
- D and colocated workers: yes. P emits one token and never decodes, so it never drafts;
  splitserve gives the option to D and colocated workers only.
- A worker that loads its prompt's KV from P (D over splitserve's connector or NIXL): only the
  methods that keep no KV of their own (`KV_FREE_METHODS`: n-gram and suffix lookup, Medusa
  and MLP-speculator heads). A drafter with attention layers (EAGLE, MTP, a draft model) keeps
  a KV cache of its own for the prompt, which P never computes and no connector moves; it is
  refused by name rather than run with a drafter blind to the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

FLAG = "--speculative-config"
SHORT_FLAG = "-sc"  # vLLM's alias
KV_FREE_METHODS = ("ngram", "ngram_gpu", "suffix", "medusa", "mlp_speculator")
NOT_ON_P = ("speculative decoding is for decode and colocated workers: a prefill worker emits "
            "one token and never decodes")


def canonical(value: str | Mapping[str, Any]) -> str:
    """`value` (JSON text or a mapping) as canonical JSON text; ValueError when it is not a
    JSON object or has no `method` or `model` (vLLM needs one of them)."""
    if isinstance(value, str):
        try:
            obj = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not JSON: {exc}") from None
    else:
        obj = dict(value)
    if not isinstance(obj, dict):
        raise ValueError("speculative config must be a JSON object, e.g. "
                         '{"method": "ngram", "num_speculative_tokens": 3, '
                         '"prompt_lookup_max": 4}')
    if not obj.get("method") and not obj.get("model"):
        raise ValueError("speculative config needs a `method` (e.g. ngram) or a draft `model`")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def check_for_role(config: str, role: str | None) -> None:
    """Raise ValueError when a worker of `role` (prefill, decode, both; None: plain) cannot draft
    with `config` (canonical JSON): never on P; on a worker whose KV comes from P, only the
    `KV_FREE_METHODS`."""
    if role == "prefill":
        raise ValueError(NOT_ON_P)
    if role is None:
        return
    method = json.loads(config).get("method")
    if method not in KV_FREE_METHODS:
        raise ValueError(
            f"speculative method {method!r} on a worker that loads its KV from P: a drafter "
            "with attention layers of its own (eagle, mtp, draft_model, ...) needs its own KV "
            "of the prompt, which P does not compute and no connector moves; use one of "
            f"{', '.join(KV_FREE_METHODS)} (or give the option to colocated workers)")


def passthrough_flag(args: tuple[str, ...] | list[str]) -> str | None:
    """The speculative flag among arguments passed to vLLM (or an abbreviation vLLM's argparse
    would expand to it), or None."""
    for arg in args:
        flag = arg.split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        if flag == SHORT_FLAG or (flag.startswith("--spec") and FLAG.startswith(flag)):
            return flag
    return None
