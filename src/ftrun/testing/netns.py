"""Nodes in network namespaces, for tests and benchmarks whose network must fail.

A bridge in this namespace joins one namespace per node, each with its own address on a private /24 (veth
pairs). Faults are the kernel's: ``cut`` drops every packet to and from a node silently (a ``blackhole`` qdisc
on both ends of its link: a partition, with no reset), ``heal`` ends that, ``reset`` kills a node's TCP
connections as a middlebox would (``ss -K``), and ``shape`` adds loss and delay where the kernel has netem.
``name`` makes a host name resolve to an address in every node (its ``/etc/hosts``, as ``ip netns exec``
mounts ``/etc/netns/NS/hosts``): a DNS name that follows a recreated pod.
Needs root and iproute2 (``available()`` says why not); ``close()`` removes everything it made.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType


def available() -> str:
    """Why namespaces cannot be used here, or "" when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "tc", "ss") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)} (apt-get install iproute2)" if missing else ""


def _tool(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} not found: apt-get install iproute2")
    return found


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=check)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run([_tool("ip"), *args], check)


@dataclass(frozen=True)
class Node:
    name: str
    netns: str
    addr: str
    host_link: str  # its veth end on the bridge, in this namespace

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside the node's namespace."""
        return [_tool("ip"), "netns", "exec", self.netns, *argv]


def _hosts(node: Node) -> Path:
    return Path("/etc/netns") / node.netns / "hosts"


class Network:
    def __init__(self, hosts_files: bool = True) -> None:
        """``hosts_files`` False: the nodes read this machine's ``/etc/hosts``, as containers that name nothing
        of their peers do (here the machine's own name is a loopback one: ``socket.getfqdn()`` says localhost)."""
        self._hosts_files = hosts_files
        self._id = secrets.token_hex(3)
        self._subnet = f"10.{200 + secrets.randbelow(50)}.{secrets.randbelow(250)}"
        self.bridge = f"ftbr{self._id}"
        self.nodes: list[Node] = []
        self._names: dict[tuple[str, str], str] = {}  # (host name, one node's namespace or "": all) -> address
        self._links = 0  # nodes added so far: each one's link and default address are its own

    @property
    def gateway(self) -> str:
        """The bridge's own address (this namespace, as seen from the nodes)."""
        return f"{self._subnet}.1"

    def start(self) -> Network:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        return self

    def add(self, name: str, addr: str = "") -> Node:
        """A node named ``name``, on a new address or on ``addr`` (a removed node's: a node requeued, a pod with a
        stable address)."""
        n = self._links
        self._links += 1
        node = Node(name, f"ft{self._id}{name}", addr or f"{self._subnet}.{n + 2}", f"fth{self._id}{n}")
        _ip("netns", "add", node.netns)
        self.nodes.append(node)  # from here on close() removes it
        _ip("link", "add", node.host_link, "type", "veth", "peer", "name", "eth0", "netns", node.netns)
        _ip("link", "set", node.host_link, "master", self.bridge, "up")
        inside = ("netns", "exec", node.netns, "ip")
        # Its hardware address follows its address: a node started again on it is the same machine to its
        # peers, whose neighbour caches would send to a gone link for ~30 s otherwise (no gratuitous ARP).
        mac = "02:00:" + ":".join(f"{int(octet):02x}" for octet in node.addr.split("."))
        _ip(*inside, "link", "set", "eth0", "address", mac)
        _ip(*inside, "addr", "add", f"{node.addr}/24", "dev", "eth0")
        _ip(*inside, "link", "set", "eth0", "up")
        _ip(*inside, "link", "set", "lo", "up")
        self._write_hosts(node)  # before anything runs there: ``ip netns exec`` mounts it over /etc/hosts
        return node

    def name(self, host: str, addr: str, only: Node | None = None) -> None:
        """Make ``host`` resolve to ``addr`` in every node (or in ``only``, over what every node has; "": not
        at all there), from now on (processes running there included)."""
        self._names[host, only.netns if only is not None else ""] = addr
        for node in self.nodes:
            self._write_hosts(node)

    def remove(self, node: Node) -> None:
        """The node gone, its namespace and link with it (its processes must be gone first); its address free."""
        _ip("netns", "del", node.netns, check=False)
        shutil.rmtree(_hosts(node).parent, ignore_errors=True)
        self.nodes.remove(node)

    def _write_hosts(self, node: Node) -> None:
        if not self._hosts_files:
            return
        named = {h: a for (h, where), a in self._names.items() if where == ""}
        named |= {h: a for (h, where), a in self._names.items() if where == node.netns}
        lines = ["127.0.0.1 localhost", f"{node.addr} {node.name}", *(f"{a} {h}" for h, a in named.items() if a)]
        path = _hosts(node)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")  # in place: a running node's mount shows the new names

    def cut(self, node: Node) -> None:
        """Partition ``node``: nothing reaches it or leaves it, and nobody is told (no reset, no ICMP)."""
        self._qdisc(node, "replace", "root", "blackhole")

    def heal(self, node: Node) -> None:
        self._qdisc(node, "del", "root", check=False)

    def shape(self, node: Node, *netem: str) -> str:
        """netem on the node's link both ways (``"loss", "5%", "delay", "50ms"``); returns why it cannot, or ""."""
        try:
            self._qdisc(node, "replace", "root", "netem", *netem)
        except subprocess.CalledProcessError as e:
            return f"netem is not available in this kernel ({e.stderr.strip()})"
        return ""

    def reset(self, node: Node, port: int) -> int:
        """Reset ``node``'s TCP connections to ``port`` (``ss -K``); returns how many were killed."""
        found = _run(node.argv([_tool("ss"), "-K", "-t", "-n", "dport", "=", f":{port}"]), check=False)
        return sum(1 for line in found.stdout.splitlines() if line.startswith("ESTAB"))

    def _qdisc(self, node: Node, action: str, *spec: str, check: bool = True) -> None:
        _run([_tool("tc"), "qdisc", action, "dev", node.host_link, *spec], check)
        _run(node.argv([_tool("tc"), "qdisc", action, "dev", "eth0", *spec]), check)

    def close(self) -> None:
        for node in self.nodes:
            _ip("netns", "del", node.netns, check=False)  # its veth pair goes with it
            shutil.rmtree(_hosts(node).parent, ignore_errors=True)
        self.nodes.clear()
        _ip("link", "del", self.bridge, check=False)

    def __enter__(self) -> Network:
        return self.start()

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
