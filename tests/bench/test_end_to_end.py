"""End to end against a real vLLM worker: result JSON, failures, compare, sweep, report."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from splitserve.bench.workload import LengthDist, WorkloadSpec, build_stream
from splitserve.cli import main
from splitserve.common.procs import stop_group
from splitserve.worker.launch import free_port, wait_healthy
from tests.support.cli import splitserve_argv
from tests.support.workers import TOKEN, Worker, hub_cache

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STREAM = ["--num-prompts", "10", "--request-rate", "20", "--input-dist", "uniform",
          "--input-min", "20", "--input-max", "300", "--output-len", "12", "--seed", "5",
          "--warmup", "1"]


@pytest.fixture(autouse=True)
def worker_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain worker holds the deployment token: the bench presents it as its key; behind a
    router, it reads the workers' /metrics with the deployment token from the environment."""
    monkeypatch.setenv("SPLITSERVE_API_KEY", TOKEN)
    monkeypatch.setenv("SPLITSERVE_TOKEN", TOKEN)


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 2000, path


def test_bench_writes_result_json_and_report(plain_worker: Worker, tmp_path: Path) -> None:
    out, rep = tmp_path / "r.json", tmp_path / "rep"
    assert main(["bench", "--url", plain_worker.url, "--result-json", str(out), "--report-dir",
                 str(rep), "--system", "plain", "--slo-ttft-ms", "60000", "--slo-tpot-ms",
                 "60000", "--repeats", "2", *STREAM]) == 0
    res = json.loads(out.read_text())  # strict JSON
    assert res["schema"] == "splitserve.bench/1" and res["system"] == "plain"
    assert (res["completed"], res["failed"], res["errors"]) == (10, 0, {})
    assert res["total_output_tokens"] == 10 * 12  # ignore_eos: every request runs to the end
    spec = WorkloadSpec(num_requests=10, input=LengthDist("uniform", 128, 20, 300),
                        output=LengthDist("fixed", 12), seed=5)
    assert res["input_lens"] == [r.input_len for r in build_stream(spec)]
    reqs = res["requests"]
    chunks = sum(len(r["chunk_times"]) for r in reqs)
    assert sum(len(x) for x in res["itls"]) == chunks - len(reqs)  # N-1 gaps per request
    assert all(sum(r["chunk_tokens"]) == 12 and r["status"] == 200 for r in reqs)
    assert all(r["request_id"] for r in reqs)
    for key in ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "p999_itl_ms",
                "max_itl_ms", "median_tpot_ms", "mean_e2el_ms", "request_throughput",
                "output_throughput"):
        assert isinstance(res[key], float) and res[key] > 0, key
    assert res["median_itl_ms"] <= res["p99_itl_ms"] <= res["p999_itl_ms"] <= res["max_itl_ms"]
    assert res["slo_attainment"] == 1.0
    assert 0.0 < res["busy_fraction"]["endpoint"] <= 1.0
    sheet = res["run_sheet"]
    assert sheet["git"]["commit"] and sheet["python"] and sheet["torch"]
    assert sheet["model"]["config_sha256"] and sheet["hardware"]["logical_cores"]
    assert sheet["workload"]["seed"] == 5 and sheet["stream"]["requests"] == 10
    assert len(res["repeats"]) == 2 and res["spread"]["completed"]["mean"] == 10
    for name in ("itl_over_time.png", "itl_cdf.png", "ttft_cdf.png"):
        assert_png(rep / name)
    html = (rep / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 3 and "plain" in html


def test_failed_requests_are_counted_not_dropped(plain_worker: Worker, tmp_path: Path) -> None:
    out = tmp_path / "f.json"
    assert main(["bench", "--url", plain_worker.url, "--result-json", str(out), "--model",
                 "no-such-model", "--slo-ttft-ms", "60000", *STREAM]) == 0
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (0, 10)
    assert res["errors"] == {"http_404": 10} and res["error_rate"] == 1.0
    assert res["slo_attainment"] == 0.0 and res["request_goodput"] == 0.0
    assert res["p99_itl_ms"] is None


def test_compare_and_sweep(plain_worker: Worker, tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    assert main(["bench", "compare", "--url", f"a={plain_worker.url}", "--url",
                 f"b={plain_worker.url}", "--out", str(out), "--slo-ttft-ms", "60000",
                 "--slo-tpot-ms", "60000", "--sweep-rates", "10,40", *STREAM]) == 0
    a, b = (json.loads((out / f"{n}.json").read_text()) for n in ("a", "b"))
    assert a["run_sheet"]["stream"]["digest"] == b["run_sheet"]["stream"]["digest"]
    assert [p["rate"] for p in a["sweep"]["points"]] == [10.0, 40.0]
    assert a["sweep"]["rate_unit"] == "req/s"
    assert a["sweep"]["distserve_goodput"]["bound"] == "lower"
    assert a["distserve_goodput"] == 40.0
    assert_png(out / "attainment_vs_rate.png")
    assert (out / "report.html").read_text().count("data:image/png;base64,") == 4


@pytest.fixture(scope="module")
def router_1p1d(llama_pair: tuple[Worker, Worker], tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[str]:
    """splitserve's router over the shared llama P/D pair."""
    p, d = llama_pair
    port = free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(
        splitserve_argv("router", "--prefill", p.url, "--decode", d.url, "--port", str(port)),
        env=os.environ | {"SPLITSERVE_TOKEN": TOKEN},
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=60)
        yield url
    finally:
        stop_group(proc, 20.0)
        log.close()


def test_bench_through_a_router_deployment(router_1p1d: str, tmp_path: Path) -> None:
    out = tmp_path / "router.json"
    assert main(["bench", "--url", router_1p1d, "--result-json", str(out), "--report-dir",
                 str(tmp_path), "--system", "1p1d", *STREAM]) == 0
    res = json.loads(out.read_text())
    assert (res["completed"], res["failed"]) == (10, 0)
    reqs = res["requests"]
    # The router echoes our X-Request-Id and reports per-leg timings we join by it.
    assert [r["request_id"] for r in reqs] == [f"1p1d-r0-{i}" for i in range(10)]
    assert all(r["server_timings"].get("mode") == "split" for r in reqs)
    assert res["server_timings"]["p_leg_s"]["count"] == 10
    assert res["median_kv_transfer_ms"] > 0
    assert {k.split(":")[0] for k in res["busy_fraction"]} == {"prefill", "decode"}
    assert all(0.0 < v <= 1.0 for v in res["busy_fraction"].values())  # P's prefill seconds
    assert {w["role"] for w in res["run_sheet"]["deployment"]["workers"]} == {
        "prefill", "decode"}
    for name in ("itl_over_time.png", "itl_cdf.png", "ttft_cdf.png"):
        assert_png(tmp_path / name)
    assert (tmp_path / "report.html").read_text().count("data:image/png;base64,") == 3


def test_compare_starts_a_deployment_itself(plain_worker: Worker, llama_ckpt: Path,
                                            tmp_path: Path) -> None:
    """The started arm loads a hub id as vLLM does, from an offline hub cache: resolved once,
    pinned to its commit, served under the id."""
    import httpx

    home, commit = tmp_path / "hf-home", "0123456789abcdef0123456789abcdef01234567"
    snapshot = hub_cache(home, "org/bench-model", llama_ckpt, commit)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE"))}
    env |= {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    out = tmp_path / "dep"
    run = subprocess.run(
        splitserve_argv("bench", "compare", "--url", f"given={plain_worker.url}", "--deploy",
                        "chunked=colocated:64", "--deploy-cores", "0,1", "--deploy-model",
                        "org/bench-model", "--out", str(out), *STREAM),
        env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    res = json.loads((out / "chunked.json").read_text())
    assert (res["completed"], res["failed"]) == (10, 0)
    dep = res["run_sheet"]["deployment"]
    assert (dep["model"], dep["revision"], Path(dep["model_dir"])) == (
        "org/bench-model", commit, snapshot)
    assert res["run_sheet"]["model"]["model"] == "org/bench-model"  # the id it was served as
    assert dep["max_num_batched_tokens"] == 64 and dep["chunked_prefill"] is True
    assert dep["worker_cpus"] == [[0, 1]] and dep["total_cores"] == 2
    with pytest.raises(httpx.HTTPError):  # the started worker is gone again
        httpx.get(f"{dep['url']}/health", timeout=2.0)
