"""``free_port`` never hands out one port twice in a process: the kernel may give a port just closed to the
next ``bind(0)``, and a configuration of several listeners would then name one port twice."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from inference import launcher


class KernelThatRepeats:
    """A socket whose ``bind(0)`` gets ports from a script, as a kernel that hands a closed port back."""

    ports: Iterator[int] = iter(())

    def __init__(self, *_: Any) -> None:
        self.port = 0

    def __enter__(self) -> KernelThatRepeats:
        return self

    def __exit__(self, *_: Any) -> None:
        pass

    def bind(self, _address: tuple[str, int]) -> None:
        self.port = next(self.ports)

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


def test_a_port_the_kernel_gives_again_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_HANDED_OUT", set())
    monkeypatch.setattr(launcher.socket, "socket", KernelThatRepeats)
    KernelThatRepeats.ports = iter([41000, 41000, 41000, 41001, 41001, 41002])
    assert [launcher.free_port() for _ in range(3)] == [41000, 41001, 41002]
    KernelThatRepeats.ports = iter([41000] * 100)
    with pytest.raises(OSError, match="no free port"):
        launcher.free_port()


def test_real_ports_are_free_and_distinct() -> None:
    ports = [launcher.free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 <= p <= 65535 for p in ports)
