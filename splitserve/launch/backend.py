"""The launcher's backend interface: what `splitserve serve` needs from a way of running a
deployment. `LocalDeployment` (local processes) and `RayDeployment` (a Ray cluster) implement it.

Contract:
- `start()` brings every worker and every router up healthy and returns the first router's URL
  (`urls` has them all); on any failure it has already stopped whatever it started, then raises
  `RuntimeError` or `TimeoutError`.
- `tend()`, called by the launcher every second, replaces what may be replaced while the rest
  serves (a router of several: its peers take the clients meanwhile) and returns a line for
  each replacement it made.
- `failures()` names the parts that stopped on their own and were not replaced (empty while
  all is well); the launcher shuts the deployment down when it is not empty.
- `stop()` drains front to back (the router first, then the workers) and leaves no process
  behind, vLLM's engine processes included. It may be called more than once. When a part
  cannot be stopped it still stops the rest, then raises `RuntimeError` naming what failed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Self


class LauncherBackend(ABC):
    """One deployment's lifetime on one kind of infrastructure."""

    @property
    @abstractmethod
    def url(self) -> str:
        """The router's base URL (the OpenAI endpoint is `url + "/v1"`)."""

    @property
    def urls(self) -> tuple[str, ...]:
        """Every router's base URL; the first is `url`."""
        return (self.url,)

    @abstractmethod
    def start(self) -> str:
        """Start everything, wait until healthy, return `url`."""

    def tend(self) -> list[str]:
        """Replace what stopped and may be replaced; one line per replacement."""
        return []

    @abstractmethod
    def failures(self) -> list[str]:
        """One line per part that stopped without being asked to."""

    @abstractmethod
    def stop(self) -> None:
        """Drain and stop every part."""

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
