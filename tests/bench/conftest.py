"""The bench package's plain worker: one vLLM worker (no connector) on the small llama
checkpoint, with the per-request cached-token count on, shared by this package's end-to-end
and multiturn tests and gone after the package (a session worker would live through
tests/nixlconnector's workers, about 3 GB each on a 24 GiB machine). The router tests'
`colocated_worker` is the same kind of worker, in its own package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import cores
from tests.support.workers import Worker, launch


@pytest.fixture(scope="package")
def plain_worker(llama_ckpt: Path) -> Iterator[Worker]:
    w = launch(llama_ckpt, "bench-plain", None, cpus=cores.BOTH,
               extra_args=("--enable-prompt-tokens-details",))
    yield w
    w.stop()
