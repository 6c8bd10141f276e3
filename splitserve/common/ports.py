"""Whether a TCP port can be bound here: the one check behind `free_port` and the "port in use"
errors of `splitserve worker`, `router` and `serve`."""

from __future__ import annotations

import errno
import socket


def bind_error(host: str, port: int, reuse: bool = False) -> OSError | None:
    """Why `port` on `host` cannot be bound now, or None when it can (`reuse`: as servers
    bind, so that a port only in TIME_WAIT counts as free)."""
    with socket.socket() as s:
        if reuse:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            return exc
        return None


def bindable(host: str, port: int, reuse: bool = False) -> bool:
    """Whether `port` on `host` can be bound now (see `bind_error`)."""
    return bind_error(host, port, reuse) is None


def check_port_free(host: str, port: int, flag: str = "--port") -> None:
    """Raise ValueError, naming the port and the flag that moves it, when `port` on `host` is
    taken (port 0, "any free one", never is); naming the host when it is no address of this
    machine or cannot be bound for another reason."""
    exc = bind_error(host, port, reuse=True)
    if exc is None:
        return
    if exc.errno == errno.EADDRINUSE:
        raise ValueError(f"port {port} on {host} is already in use: stop what listens there, "
                         f"or choose another port with {flag}")
    raise ValueError(f"cannot listen on {host}:{port}: {exc.strerror or exc} (is {host} an "
                     "address of this machine?)")
