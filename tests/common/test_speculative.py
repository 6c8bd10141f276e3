"""Speculative decoding's option (pure logic): validated for a worker's role, given to D and
colocated workers only (never P), on `splitserve worker`, `serve` and the YAML, and passed to
vLLM as `--speculative-config`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.cli import build_parser
from splitserve.common.speculative import canonical, check_for_role, passthrough_flag
from splitserve.config import WorkerConfig
from splitserve.launch.cli import config_from_args
from splitserve.launch.config import DeploymentConfig, load_yaml
from splitserve.launch.local import LocalDeployment
from splitserve.worker.launch import worker_command

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}'


def test_canonical_json_and_what_is_not_a_config() -> None:
    assert canonical(NGRAM) == canonical({"prompt_lookup_max": 4, "method": "ngram",
                                          "num_speculative_tokens": 3})
    assert json.loads(canonical(NGRAM))["num_speculative_tokens"] == 3
    for bad, match in (("{nope", "not JSON"), ("[1]", "JSON object"), ("{}", "method"),
                       ('{"num_speculative_tokens": 3}', "method")):
        with pytest.raises(ValueError, match=match):
            canonical(bad)


def test_never_on_p_and_only_kv_free_drafters_where_kv_comes_from_p() -> None:
    with pytest.raises(ValueError, match="never decodes"):
        check_for_role(canonical(NGRAM), "prefill")
    check_for_role(canonical(NGRAM), "decode")
    eagle = canonical({"method": "eagle", "model": "some/eagle", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="'eagle'.*ngram, ngram_gpu, suffix"):
        check_for_role(eagle, "decode")
    with pytest.raises(ValueError, match="None"):  # a draft model named only by its path
        check_for_role(canonical({"model": "some/draft"}), "decode")
    check_for_role(eagle, None)  # colocated: any method vLLM takes


def test_passthrough_flag_and_its_spellings() -> None:
    assert passthrough_flag(["--max-num-seqs", "4"]) is None
    for arg in ("--speculative-config", "--speculative_config={}", "-sc",
                "--speculative-config.method=ngram", "--spec"):
        assert passthrough_flag([arg]) is not None, arg


def test_worker_config_gives_vllm_the_flag_and_refuses_p(tmp_path: Path) -> None:
    d = WorkerConfig(model=str(tmp_path), port=8100, role="decode", kv_port=8101,
                     speculative_config=NGRAM)
    argv, _ = worker_command(d, "token")
    assert argv[argv.index("--speculative-config") + 1] == canonical(NGRAM)
    plain = WorkerConfig(model=str(tmp_path), port=8100)
    assert "--speculative-config" not in worker_command(plain, None)[0]
    with pytest.raises(ValueError, match="never decodes"):
        WorkerConfig(model=str(tmp_path), port=8100, role="prefill", kv_port=8101,
                     speculative_config=NGRAM)
    with pytest.raises(ValueError, match="never decodes"):  # also after `--`
        WorkerConfig(model=str(tmp_path), port=8100, role="prefill", kv_port=8101,
                     extra_args=("--speculative-config", NGRAM))
    with pytest.raises(ValueError, match="give it once"):
        WorkerConfig(model=str(tmp_path), port=8100, role="decode", kv_port=8101,
                     speculative_config=NGRAM, extra_args=("-sc", NGRAM))


def test_a_deployment_gives_it_to_d_and_colocated_workers_only(tmp_path: Path) -> None:
    f = tmp_path / "d.yaml"
    f.write_text("prefill: 1\ndecode: 2\ncolocated: 1\ncpus: [0, 1]\n"
                 "speculative: {method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 4}\n")
    cfg = load_yaml(f)
    assert cfg.speculative == canonical(NGRAM)
    planned = [w for _, w in LocalDeployment(cfg).plan_workers()]
    assert [(w.role, w.speculative_config) for w in planned] == [
        ("prefill", None), ("decode", canonical(NGRAM)), ("decode", canonical(NGRAM)),
        (None, canonical(NGRAM))]


def test_serve_flag_and_refusals() -> None:
    args = build_parser().parse_args(["serve", "--prefill", "1", "--decode", "1",
                                      "--speculative-config", NGRAM])
    assert config_from_args(args).speculative == canonical(NGRAM)
    with pytest.raises(ValueError, match="every worker, P too"):
        DeploymentConfig(prefill=1, decode=1, worker_args=("--speculative-config", NGRAM))
    with pytest.raises(ValueError, match="'eagle'"):
        DeploymentConfig(prefill=1, decode=1, speculative='{"method": "eagle", "model": "m"}')
    # a colocated deployment takes any method vLLM does
    assert DeploymentConfig(colocated=1, speculative='{"method": "eagle", "model": "m"}')
