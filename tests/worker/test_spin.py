"""The worker's busy-poll window (`worker.spin`): vLLM's own queue readers take it, the launcher
passes it, and a window that would stall steps is refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

from splitserve.config import IDLE_SPIN_S, WorkerConfig
from splitserve.worker.launch import worker_command
from splitserve.worker.spin import SPIN_ENV, apply, parse_spin


@pytest.fixture
def pristine_spin() -> Iterator[None]:
    """vLLM's SpinCondition as it was before the test patched it."""
    init = SpinCondition.__init__
    yield
    SpinCondition.__init__ = init
    if "splitserve_spin_s" in vars(SpinCondition):
        del SpinCondition.splitserve_spin_s


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)  # closes every socket the SpinConditions opened


def reader_and_writer(ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path, name: str
                      ) -> tuple[SpinCondition, SpinCondition]:
    address = f"ipc://{tmp_path}/{name}"
    writer = SpinCondition(is_reader=False, context=ctx, notify_address=address)
    return SpinCondition(is_reader=True, context=ctx, notify_address=address), writer


def test_readers_made_after_the_plugin_busy_poll_for_the_window(
        pristine_spin: None, ctx: zmq.Context[zmq.Socket[bytes]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SPIN_ENV, raising=False)
    apply()  # unset: vLLM's own window
    assert reader_and_writer(ctx, tmp_path, "a")[0].busy_loop_s == 1
    monkeypatch.setenv(SPIN_ENV, "0.1")
    apply()
    reader, writer = reader_and_writer(ctx, tmp_path, "b")
    assert reader.busy_loop_s == 0.1 and writer.busy_loop_s == 0  # the writer never waits
    monkeypatch.setenv(SPIN_ENV, "0.25")
    apply()  # loaded again in the same process: the last window holds, patched once
    assert reader_and_writer(ctx, tmp_path, "c")[0].busy_loop_s == 0.25


def test_a_vllm_without_the_window_is_left_alone(
        pristine_spin: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from vllm.distributed.device_communicators import shm_broadcast

    class Elsewise:  # a later vLLM whose queues spin some other way
        def __init__(self, is_reader: bool) -> None:
            self.is_reader = is_reader

    init = Elsewise.__init__
    monkeypatch.setattr(shm_broadcast, "SpinCondition", Elsewise)
    monkeypatch.setenv(SPIN_ENV, "0.1")
    with caplog.at_level("WARNING", logger="vllm.splitserve.spin"):
        apply()
    assert Elsewise.__init__ is init and "changes nothing" in caplog.text


@pytest.mark.parametrize("text", ["0", "0.05", "-1", "nan"])
def test_a_window_that_would_stall_steps_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="at least"):
        parse_spin(text)


def test_the_launcher_passes_the_window_to_every_worker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SPIN_ENV, "7")  # never inherited from the launcher's own environment
    env = worker_command(WorkerConfig(model=str(tmp_path), port=8100), None)[1]
    assert parse_spin(env[SPIN_ENV]) == IDLE_SPIN_S == 0.1
    plain = worker_command(WorkerConfig(model=str(tmp_path), port=8100, idle_spin_s=None), None)
    assert SPIN_ENV not in plain[1]
    with pytest.raises(ValueError, match="stalled steps"):
        WorkerConfig(model=str(tmp_path), port=8100, idle_spin_s=0.0)


def test_vllm_loads_the_plugin_in_a_worker_s_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.plugins import DEFAULT_PLUGINS_GROUP, load_plugins_by_group

    monkeypatch.setenv("VLLM_PLUGINS", "splitserve")  # as worker_command sets it
    assert load_plugins_by_group(DEFAULT_PLUGINS_GROUP) == {"splitserve": apply}


def test_the_worker_command_line_sets_the_window(tmp_path: Path) -> None:
    import argparse

    from splitserve.worker import cli as worker_cli

    p = argparse.ArgumentParser()
    worker_cli.add_worker_arguments(p)
    base = ["--model", str(tmp_path), "--port", "8000"]
    assert worker_cli.config_from_args(p.parse_args(base), []).idle_spin_s == IDLE_SPIN_S
    cfg = worker_cli.config_from_args(p.parse_args([*base, "--idle-spin-ms", "250"]), [])
    assert cfg.idle_spin_s == 0.25
    for short in ("0", "50"):
        with pytest.raises(ValueError, match=f"--idle-spin-ms must be at least 100, got {short}"):
            worker_cli.config_from_args(p.parse_args([*base, "--idle-spin-ms", short]), [])
