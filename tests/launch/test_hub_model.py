"""A Hugging Face model id served as vLLM serves one, without a network: `splitserve serve
--model org/name` (1P+1D) in a user's environment whose `HF_HOME` holds the model in the hub's
cache layout and `HF_HUB_OFFLINE=1`. The checkpoint has 32,768 positions and no
--max-model-len is given: the deployment reports the model's own length and serves a prompt
longer than the tests' other models hold; completions and chat (the router's tokenizer, from the
same snapshot) are token-exact against transformers on the snapshot's weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from splitserve.worker.launch import free_port
from tests.support.cli import splitserve_argv
from tests.support.workers import chat_prompt_ids, hf_greedy, hub_cache, make_checkpoint

REPO = "org/name"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hub_home(checkpoint_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("hf-home")
    hub_cache(home, REPO, make_checkpoint(checkpoint_root, "llama-32k"), COMMIT)
    return home


def test_serve_a_hub_id_offline_at_its_native_length(hub_home: Path, tmp_path: Path) -> None:
    snapshot = hub_home / "hub" / "models--org--name" / "snapshots" / COMMIT
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1"}
    out_path = tmp_path / "serve.out"
    out = open(out_path, "w+")  # noqa: SIM115
    proc = subprocess.Popen(
        splitserve_argv("serve", "--model", REPO, "--prefill", "1", "--decode", "1", "--port",
                        str(port), "--log-dir", str(tmp_path / "logs")),
        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    workers: list[str] = []
    try:
        deadline = time.monotonic() + 300
        while "splitserve: ready" not in out_path.read_text():
            assert proc.poll() is None, out_path.read_text()
            assert time.monotonic() < deadline, "deployment not ready in time"
            time.sleep(0.5)
        assert f"model {REPO}" in out_path.read_text()
        workers = [w["url"] for w in httpx.get(f"{url}/workers").json()["workers"]]
        model = httpx.get(f"{url}/v1/models").json()["data"][0]
        assert model["id"] == REPO and model["max_model_len"] == 32768
        assert Path(model["root"]) == snapshot

        long_prompt = [3 + (i * 13) % 1000 for i in range(3000)]  # beyond 2,048 positions
        for prompt in ([5, 9, 200, 17], [3 + (i * 7) % 1000 for i in range(300)], long_prompt):
            r = httpx.post(f"{url}/v1/completions", timeout=120, json={
                "model": REPO, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            timings = json.loads(r.headers["x-splitserve-timings"])
            assert timings["mode"] == "split" and timings["kv_status"] == "loaded", timings
            assert r.json()["choices"][0]["token_ids"] == hf_greedy(snapshot, prompt,
                                                                    MAX_TOKENS)

        messages = [{"role": "user", "content": "Where is the sea?"}]
        prompt = chat_prompt_ids(snapshot, messages)
        r = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
            "model": REPO, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}).json()
        assert r["prompt_token_ids"] == prompt
        assert r["choices"][0]["token_ids"] == hf_greedy(snapshot, prompt, MAX_TOKENS)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        out.close()
    assert proc.returncode == 0, out_path.read_text()
    assert len(workers) == 2
    for w in workers:
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{w}/health", timeout=2)
