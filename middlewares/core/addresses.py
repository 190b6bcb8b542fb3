"""Which addresses the image fetcher may reach: public unicast ones only, unless configured.

The check runs on the addresses a name resolves to, inside the connector's resolver, so the
connection goes to the very address that was checked (a rebinding DNS server gets no second
lookup), and odd IPv4 spellings (2130706433, 0177.0.0.1, 127.1) are judged by what they resolve to.
"""

from __future__ import annotations

import ipaddress
import re
import socket

from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import DefaultResolver

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# IANA's special-purpose blocks that Python's is_global calls global before 3.11.10 and 3.12.4
# (protocol assignments, documentation, local-use NAT64), so that no interpreter lets them by.
_SPECIAL = tuple(
    ipaddress.ip_network(block)
    for block in (
        "192.0.0.0/24",
        "192.88.99.0/24",
        "2001::/23",
        "3fff::/20",
        "64:ff9b:1::/48",
    )
)
_NUMERIC_HOST = re.compile(r"[0-9a-fA-FxX.]+")


class PrivateAddress(OSError):
    """The host resolves to no public address."""


def is_public(ip: IPAddress) -> bool:
    """A global unicast address, and so is any IPv4 address an IPv6 one carries."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not is_public(embedded):
            return False
        if ip.is_site_local:  # fec0::/10: deprecated, yet still routed inside some networks
            return False
    return ip.is_global and not (
        ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or ip.is_loopback
        or any(ip in block for block in _SPECIAL)
    )


def literal_address(host: str) -> IPAddress | None:
    """The address a URL host names literally, or None for a name. Covers "[::1]" and the old
    IPv4 spellings C's inet_aton still accepts: 2130706433, 0177.0.0.1, 0x7f.1, 127.1."""
    try:
        return ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        pass
    if _NUMERIC_HOST.fullmatch(host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            pass
    return None


class PublicOnlyResolver(AbstractResolver):
    """Resolves as usual, then keeps only public addresses; none left is an error."""

    def __init__(self, inner: AbstractResolver | None = None) -> None:
        self._inner = inner or DefaultResolver()

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        public = [entry for entry in found if is_public(ipaddress.ip_address(entry["host"].split("%", 1)[0]))]
        if not public:
            raise PrivateAddress(f"{host} is not a public address")
        return public

    async def close(self) -> None:
        await self._inner.close()
