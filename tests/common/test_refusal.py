"""`splitserve.common.refusal`: bad input is refused in one line, `splitserve COMMAND: reason`,
with exit status 2, before a command's real work; an error of that work (a measurement, a
server) keeps its type and traceback. No process is started: each command's real work is
replaced by one that fails."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

import pytest

from splitserve.cli import main
from splitserve.common.refusal import EXIT_REFUSED, Refused, refuse, refusing
from splitserve.sim.model import Profile, save_profile
from splitserve.worker.launch import free_port
from tests.sim.conftest import make_profile

WORKLOAD = ["--num-prompts", "5", "--request-rate", "2", "--input-len", "40",
            "--output-len", "4"]


def crash(*args: object, **kwargs: object) -> Profile:
    """A measurement that fails part-way (a bug, a worker that died)."""
    raise ValueError("crashed while measuring")


@pytest.mark.parametrize("error", [ValueError("bad --x"), OSError(2, "No such file"),
                                   FileNotFoundError("p.json")])
def test_input_errors_in_the_scope_are_refused(error: Exception) -> None:
    with pytest.raises(Refused) as refused:
        with refusing("sim validate"):
            raise error
    assert refused.value.command == "sim validate" and refused.value.why is error
    assert str(refused.value) == f"splitserve sim validate: {error}"
    assert refused.value.__cause__ is error  # the original, for whoever debugs it


def test_other_errors_and_refusals_pass_unchanged() -> None:
    with pytest.raises(KeyError):
        with refusing("plan"):
            raise KeyError("a bug")
    with pytest.raises(RuntimeError):
        with refusing("worker"):
            raise RuntimeError("not an input error unless asked")
    with pytest.raises(Refused, match="^splitserve worker: pinned"):
        with refusing("worker", RuntimeError):
            raise RuntimeError("pinned")
    with pytest.raises(Refused, match="^splitserve bench compare: inner$"):
        with refusing("bench"):  # a nested command's refusal keeps its own name
            raise Refused("bench compare", "inner")
    with refusing("sim"):
        pass  # nothing raised: nothing refused


def test_as_a_decorator_the_whole_function_is_in_scope() -> None:
    @refusing("sim")
    def command(args: argparse.Namespace) -> int:
        if args.n < 1:
            raise ValueError("--n must be >= 1")
        return 0

    assert command(argparse.Namespace(n=1)) == 0
    with pytest.raises(Refused, match="^splitserve sim: --n must be >= 1$"):
        command(argparse.Namespace(n=0))
    with pytest.raises(Refused):  # the decorated function can be called again
        command(argparse.Namespace(n=-1))


def test_refuse_prints_one_line_and_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert refuse("bench", "--url and --result-json are required") == EXIT_REFUSED == 2
    out = capsys.readouterr()
    assert out.err == "splitserve bench: --url and --result-json are required\n"
    assert out.out == ""


def test_main_refuses_in_one_line_with_status_2(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    cases = [
        (["bench"], "splitserve bench: --url and --result-json are required"),
        (["bench", "--url", "http://127.0.0.1:1", "--result-json", str(tmp_path / "r.json"),
          "--num-prompts", "0"], "splitserve bench: num_requests must be >= 1"),
        (["bench", "compare", "--url", "a=http://127.0.0.1:1"],
         "splitserve bench compare: give at least two of --url NAME=URL and --deploy"),
        (["sim", "--profile", "/nonexistent"], "splitserve sim: [Errno 2]"),
        (["sim", "validate", "--profile", "/nonexistent"], "splitserve sim validate: [Errno 2]"),
    ]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        cases.append((["router", "--colocated", "http://127.0.0.1:1", "--port", port],
                      f"splitserve router: port {port} on 127.0.0.1 is already in use"))
        for argv, said in cases:
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith(said) and len(err.strip().splitlines()) == 1, (argv, err)
    assert not list(tmp_path.iterdir())


def test_sim_validate_keeps_the_traceback_of_its_measurement(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The inputs read, the measurement fails: its ValueError leaves `main` as it is, with the
    frame it was raised in, not as one line and exit status 2."""
    from splitserve.sim.validate_cli import Validation

    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    monkeypatch.setattr(Validation, "run", crash)
    with pytest.raises(ValueError, match="crashed while measuring") as raised:
        main(["sim", "validate", "--profile", str(prof), "--mode", "chunked", "--workers", "1",
              "--rates", "1", *WORKLOAD])
    assert raised.traceback[-1].name == "crash"


def test_sim_validate_refuses_options_before_anything_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--reprofile` on a deployment it would launch, and `--real-json` that cannot be read:
    refused (the stored runs are simulated again, computation on the inputs)."""
    from splitserve.sim.validate_cli import Validation

    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    base = ["sim", "validate", "--profile", str(prof), *WORKLOAD]
    started = Validation.on_deployment

    def not_started(self: Validation) -> object:
        raise AssertionError(f"{started.__name__} ran")

    monkeypatch.setattr(Validation, "on_deployment", not_started)
    assert main([*base, "--mode", "disagg", "--reprofile"]) == 2
    assert capsys.readouterr().err.startswith(
        "splitserve sim validate: --reprofile works with one plain worker")
    assert main([*base, "--real-json", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("splitserve sim validate: [Errno 2]")


def test_profile_refuses_its_inputs_first_and_keeps_a_measurements_traceback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.sim import profile

    monkeypatch.setattr(profile, "profile_worker", crash)
    out = tmp_path / "out.json"
    url = ["profile", "--url", "http://127.0.0.1:1", "--out", str(out)]
    # a --transfer-json that cannot be read: refused before the worker is measured
    assert main([*url, "--transfer-json", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("splitserve profile: [Errno 2]")
    (tmp_path / "bad.json").write_text("{not json")
    assert main([*url, "--transfer-json", str(tmp_path / "bad.json")]) == 2
    assert capsys.readouterr().err.startswith("splitserve profile: Expecting property name")
    with pytest.raises(ValueError, match="crashed while measuring") as raised:
        main(url)
    assert raised.traceback[-1].name == "crash"
    assert not out.exists()


def test_advise_keeps_the_traceback_of_its_profiling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from splitserve.sim import advise

    monkeypatch.setattr(advise, "measured_profile", crash)
    argv = ["advise", "--hardware", "cpu", "--gpus", "2", "--slo-ttft-ms", "1000",
            "--slo-tpot-ms", "100", *WORKLOAD, "--out-dir", str(tmp_path / "advise")]
    with pytest.raises(ValueError, match="crashed while measuring") as raised:
        main(argv)
    assert raised.traceback[-1].name == "crash"
    # the plan's own check of an option, with a profile given (nothing measured): refused
    prof = tmp_path / "p.json"
    save_profile(make_profile(), prof)
    assert main([*argv, "--profile", str(prof), "--policies", "cache,best"]) == 2
    assert capsys.readouterr().err.startswith("splitserve advise: unknown --policies ['best']")


def test_router_keeps_the_traceback_of_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    from splitserve.router import cli

    def serve(*args: object, **kwargs: object) -> None:
        raise OSError(98, "Address already in use")  # after the checks: a race, not input

    monkeypatch.setattr(cli, "serve", serve)
    with pytest.raises(OSError, match="Address already in use") as raised:
        main(["router", "--colocated", "http://127.0.0.1:1", "--port", str(free_port())])
    assert raised.traceback[-1].name == "serve"
