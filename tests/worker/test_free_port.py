"""`free_port` stays out of the kernel's ephemeral range, wherever that range lies;
`check_port_free` tells a port in use from a host that cannot be listened on."""

from __future__ import annotations

import socket

import pytest

from splitserve.common.ports import check_port_free
from splitserve.worker import launch


@pytest.mark.parametrize("ephemeral", [
    (32768, 60999),  # Linux's default: room below and above
    (1024, 65000),  # a range from 1024 up: room above only
    (1040, 50000),  # a little room below, more above
])
def test_a_port_outside_the_ephemeral_range(monkeypatch: pytest.MonkeyPatch,
                                            ephemeral: tuple[int, int]) -> None:
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: ephemeral)
    low, high = ephemeral
    for count in (1, 2) * 20:  # never runs out while there is room on either side
        port = launch.free_port(count=count)
        last = port + count - 1
        assert 1024 <= port and last <= 65535
        assert not low <= port <= high and not low <= last <= high
        with socket.socket() as s:  # free now
            s.bind(("127.0.0.1", port))


def test_no_room_outside_falls_back_to_the_kernels_choice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (1024, 65535))
    assert 0 < launch.free_port() < 65536
    with pytest.raises(RuntimeError, match="consecutive"):
        launch.free_port(count=2)


def test_ports_to_avoid_are_never_given_nor_a_routers_to_a_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Room for five ports (65531-65535) outside the ephemeral range: four avoided leave one;
    a local deployment's workers never get its routers' ports (free until the routers start,
    after the workers)."""
    from splitserve.common.vocab import Role
    from splitserve.launch.config import DeploymentConfig
    from splitserve.launch.local import pool_worker_config

    monkeypatch.setattr(launch, "_ephemeral_range", lambda: (1024, 65530))
    routers = (65531, 65532, 65533, 65534)
    for _ in range(10):
        monkeypatch.setattr(launch, "_HANDED_OUT", [])  # each time: none given out yet
        assert launch.free_port(avoid=routers) == 65535
    cfg = DeploymentConfig(prefill=1, decode=1, port=65531, routers=4)
    assert cfg.router_ports == routers
    for _ in range(5):
        monkeypatch.setattr(launch, "_HANDED_OUT", [])
        w = pool_worker_config(cfg, Role.PREFILL, "m", None, "127.0.0.1", None)
        assert w.port not in routers and w.kv_port not in routers


def test_a_port_in_use_and_a_host_not_here_are_told_apart() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"port {port} on 127.0.0.1 is already in use"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", 0)
    for host in ("999.1.1.1", "192.0.2.1"):  # no address at all; an address of no one here
        with pytest.raises(ValueError, match=f"cannot listen on {host}:8123"):
            check_port_free(host, 8123)
