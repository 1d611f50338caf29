"""Which network addresses are internal: loopback, private, link-local (the cloud metadata
services among them), shared, reserved and the like, where no outside receiver lives and where a
request from inside the deployment reaches what the outside must not (pure logic).

A URL a person configures (``release.webhooks``) is refused when it points there, unless the
deployment says it means to (``release.webhook_allow_internal``): a webhook URL is posted to by the
controller from inside the cluster, so one aimed at ``http://169.254.169.254/...`` or at a
database's port would make the controller a proxy into the deployment's own network. Settings check
a literal address at load (:func:`literal_ip`); a name is checked after it resolves, at each send
(release/webhooks.py), since its answer may change.
"""

from __future__ import annotations

import ipaddress
import socket

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Ranges Python 3.11's ``is_global`` counts as global though nothing outside lives there: the
#: IETF protocol assignments (192.0.0.0/24, where Oracle Cloud answers metadata at 192.0.0.192).
_NOT_GLOBAL = (ipaddress.ip_network("192.0.0.0/24"),)
#: NAT64's well-known prefix: the last 32 bits are the IPv4 address a translator reaches
#: (64:ff9b::a9fe:a9fe is 169.254.169.254 behind it).
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def is_internal(ip: IPAddress) -> bool:
    """Whether ``ip`` is anything but a globally reachable unicast address (module docstring).

    An IPv6 address that carries an IPv4 one (mapped ``::ffff:a.b.c.d``, 6to4 ``2002::/16``,
    NAT64 ``64:ff9b::/96``) is judged by the IPv4 address it reaches too."""
    if isinstance(ip, ipaddress.IPv6Address):
        carried = ip.ipv4_mapped or ip.sixtofour
        if carried is None and ip in _NAT64:
            carried = ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
        if carried is not None and is_internal(carried):
            return True
        if ip.ipv4_mapped is not None:
            return False  # judged by the IPv4 address alone (::ffff:0:0/96 is not "global" itself)
    return not ip.is_global or ip.is_multicast or any(ip in net for net in _NOT_GLOBAL)


def literal_ip(host: str) -> IPAddress | None:
    """The address ``host`` (a URL's host, brackets removed) writes literally, else None (a name).

    Besides the usual forms, the shorthand IPv4 forms the resolver reads as addresses count:
    ``127.1``, ``2130706433``, ``0x7f000001`` all reach 127.0.0.1."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefxABCDEFX." for c in host):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


__all__ = ["IPAddress", "is_internal", "literal_ip"]
