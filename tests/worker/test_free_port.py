"""`free_port` stays out of the kernel's ephemeral range, wherever that range lies."""

from __future__ import annotations

import socket

import pytest

from splitserve.worker import launch


@pytest.mark.parametrize(("ephemeral", "outside"), [
    ((32768, 60999), range(20768, 32768)),  # Linux's default: below it
    ((1024, 65000), range(65001, 65536)),  # a range from 1024 up: above it
])
def test_a_port_outside_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch,
                                            ephemeral: tuple[int, int],
                                            outside: range) -> None:
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: ephemeral)
    for count in (1, 2):
        port = launch.free_port(count=count)
        assert port in outside and port + count - 1 in outside
        with socket.socket() as s:  # free now
            s.bind(("127.0.0.1", port))


def test_no_room_outside_falls_back_to_the_kernels_choice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (1024, 65535))
    assert 0 < launch.free_port() < 65536
    with pytest.raises(RuntimeError, match="consecutive"):
        launch.free_port(count=2)
