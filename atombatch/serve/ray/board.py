"""The board: a detached Ray actor per application holding what every replica last reported
and the registry of the application's PD producers."""

from __future__ import annotations

import time
from typing import Any

import ray

DEFAULT_APP = "atombatch"
BOARD_NAMESPACE = "atombatch"


class Board:
    """A Ray actor holding each replica's last report (engine stats and metrics text) and the
    application's registry of PD producers.

    Replicas report every `report_s`; a report older than `stale_s` is dropped (a dead replica
    leaves the board by going silent).
    """

    def __init__(self, stale_s: float = 5.0) -> None:
        self.stale_s = stale_s
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._producers: dict[str, tuple[str, Any]] = {}   # name -> (endpoint, actor handle)
        self._producer_args: list[str] | None = None

    def set_producer_args(self, args: list[str]) -> None:
        """The engine flags new producers of this application get by default."""
        self._producer_args = list(args)

    def producer_args(self) -> list[str] | None:
        return self._producer_args

    def register_producer(self, name: str, endpoint: str, actor: Any) -> None:
        self._producers[name] = (endpoint, actor)

    def deregister_producer(self, name: str, endpoint: str | None = None) -> bool:
        """Remove a producer (only if still at `endpoint`, when given)."""
        current = self._producers.get(name)
        if current is None or (endpoint is not None and current[0] != endpoint):
            return False
        del self._producers[name]
        return True

    def producers(self) -> dict[str, tuple[str, Any]]:
        """The registered PD producers: name -> (ZeroMQ endpoint, actor handle)."""
        return dict(self._producers)

    def report(self, replica: str, report: dict[str, Any]) -> None:
        self._reports[replica] = (time.monotonic(), report)

    def leave(self, replica: str) -> None:
        self._reports.pop(replica, None)

    def reports(self) -> dict[str, dict[str, Any]]:
        now = time.monotonic()
        self._reports = {k: v for k, v in self._reports.items() if now - v[0] <= self.stale_s}
        return {k: v[1] for k, v in self._reports.items()}


def board(app_name: str = DEFAULT_APP) -> Any:
    """The application's board actor (created on first use; detached, no CPU)."""
    actor = ray.remote(num_cpus=0)(Board)
    return actor.options(name=f"board-{app_name}", namespace=BOARD_NAMESPACE,
                         get_if_exists=True, lifetime="detached").remote()
