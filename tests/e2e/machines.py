"""Simulated machines for process tests: network namespaces on one bridge (root and
iproute2 needed; the fixture that builds them is in conftest.py)."""

from __future__ import annotations

import os
import subprocess


class TwoMachines:
    """Two simulated machines for the controller: network namespaces on one bridge with
    this namespace (where the relays and ranks run), and one service address that is
    on the first machine, until :meth:`move_address` gives it to the second (as a
    floating IP or a DNS name that an operator points at a replacement machine)."""

    SUBNET = "10.231.9"

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.bridge = f"fts{tag}"
        self.names = (f"ftsa{tag}", f"ftsb{tag}")
        self.address = f"{self.SUBNET}.100"
        self._made: list[list[str]] = []

    def wrap(self, machine: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[machine]]

    def _ip(self, *args: str, undo: list[str] | None = None) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)
        if undo is not None:
            self._made.append(undo)

    def build(self) -> None:
        self._ip("link", "add", self.bridge, "type", "bridge", undo=["link", "del", self.bridge])
        self._ip("addr", "add", f"{self.SUBNET}.1/24", "dev", self.bridge)
        self._ip("link", "set", self.bridge, "up")
        for index, name in enumerate(self.names):
            self._ip("netns", "add", name, undo=["netns", "del", name])
            outside, inside = f"{name}o", f"{name}i"
            self._ip("link", "add", outside, "type", "veth", "peer", "name", inside, undo=["link", "del", outside])
            self._ip("link", "set", inside, "netns", name)
            self._ip("link", "set", outside, "master", self.bridge, "up")
            self._ip("-n", name, "addr", "add", f"{self.SUBNET}.{10 + index}/24", "dev", inside)
            self._ip("-n", name, "link", "set", inside, "up")
            self._ip("-n", name, "link", "set", "lo", "up")
        self._ip("-n", self.names[0], "addr", "add", f"{self.address}/24", "dev", f"{self.names[0]}i")

    def move_address(self) -> None:
        """The service address leaves the first machine for the second; this namespace
        forgets where it was (what the new machine's gratuitous ARP does on a LAN)."""
        self._ip("-n", self.names[0], "addr", "del", f"{self.address}/24", "dev", f"{self.names[0]}i")
        self._ip("-n", self.names[1], "addr", "add", f"{self.address}/24", "dev", f"{self.names[1]}i")
        subprocess.run(["ip", "neigh", "flush", "to", self.address], capture_output=True)

    def machine_of(self, pid: int) -> str:
        """The namespace a process runs in, as ``ip netns identify`` names it."""
        return subprocess.run(["ip", "netns", "identify", str(pid)], capture_output=True, text=True).stdout.strip()

    def tear_down(self) -> None:
        for undo in reversed(self._made):
            subprocess.run(["ip", *undo], capture_output=True)
