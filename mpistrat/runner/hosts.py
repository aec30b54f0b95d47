"""Ranks and hosts in words, and this host's addresses: what the watchdog and the job
monitors share. Only the standard library: the job monitor's own process
(:mod:`.sidecar`) imports it without the rest of mpistrat."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable, Sequence
from typing import cast

__all__ = ["group_by_host", "name_ranks", "local_addresses", "interface_address",
           "route_sources"]


def group_by_host(ranks: Iterable[int], hostnames: Sequence[str]) -> dict[str, list[int]]:
    """``ranks`` grouped by their host, hosts in the order of their lowest rank."""
    groups: dict[str, list[int]] = {}
    for rank in sorted(ranks):
        groups.setdefault(hostnames[rank], []).append(rank)
    return groups


def _ranks_in_words(ranks: Sequence[int]) -> str:
    """``rank 3`` or ``ranks 2, 3``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else \
        "ranks " + ", ".join(str(r) for r in ranks)


def name_ranks(ranks: Iterable[int], hostnames: Sequence[str]) -> str:
    """Ranks in words, by host: a host all of whose ranks are listed is named as one
    (``host node2 (ranks 2, 3)``), the others rank by rank (``rank 3 (node1)``)."""
    parts = []
    for host, members in group_by_host(ranks, hostnames).items():
        everyone = [r for r, h in enumerate(hostnames) if h == host]
        if members == everyone:
            parts.append(f"host {host} ({_ranks_in_words(members)})")
        else:
            parts.append(f"{_ranks_in_words(members)} ({host})")
    return "; ".join(parts) if len(parts) > 2 else " and ".join(parts)


def interface_address(name: str) -> str | None:
    """The IPv4 address of network interface ``name`` (None: no such interface, no
    IPv4 address on it, or not a POSIX system)."""
    try:
        import fcntl  # POSIX only: the rest of the module works without it

        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            packed = fcntl.ioctl(probe.fileno(), 0x8915,  # SIOCGIFADDR
                                 struct.pack("256s", name.encode()[:15]))
        finally:
            probe.close()
    except (ImportError, OSError, AttributeError):
        return None
    return socket.inet_ntoa(packed[20:24])


def local_addresses() -> list[str]:
    """This host's IPv4 addresses other than loopback (every interface's, and what the
    host name resolves to), for peers on other hosts to send probes to."""
    found: list[str] = []
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    for name in names:
        address = interface_address(name)
        if address is not None:
            found.append(address)
    try:
        for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET):
            found.append(cast(str, info[4][0]))  # (AF_INET: the address is a str)
    except OSError:
        pass
    unique = []
    for address in found:
        if not address.startswith("127.") and address not in unique:
            unique.append(address)
    return unique


def route_sources(addresses: Iterable[str]) -> list[str]:
    """The addresses of this host that packets to ``addresses`` leave from (what the
    routing table picks; nothing is sent), each once, in order."""
    found: list[str] = []
    for address in addresses:
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            probe.connect((address, 9))  # (a datagram socket's connect only routes)
            source = cast(str, probe.getsockname()[0])
        except OSError:
            continue  # no route: it cannot be reached from here at all
        finally:
            probe.close()
        if source not in found:
            found.append(source)
    return found
