"""Which addresses a webhook may not reach unless allowed (flywheel/addresses.py), one row each."""

from __future__ import annotations

import ipaddress

import pytest

from flywheel.addresses import is_internal, literal_ip


@pytest.mark.parametrize(("address", "internal"), [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True),  # loopback
    ("169.254.169.254", True), ("fd00:ec2::254", True),  # AWS metadata, IPv4 and IPv6
    ("169.254.1.1", True), ("fe80::1", True), ("fe80::1%eth0", True),  # link-local
    ("10.0.0.1", True), ("172.16.5.4", True), ("192.168.1.1", True), ("fc00::1", True),  # private
    ("100.64.0.1", True), ("100.100.100.200", True),  # shared (CGNAT): Alibaba Cloud's metadata
    ("192.0.0.192", True),  # IETF protocol block: Oracle Cloud's metadata (3.11 calls it global)
    ("0.0.0.0", True), ("::", True), ("240.0.0.1", True), ("255.255.255.255", True),
    ("224.0.0.1", True), ("ff02::1", True),  # multicast
    ("198.18.0.1", True), ("192.0.2.1", True), ("2001:db8::1", True),  # benchmarking, documentation
    ("::ffff:127.0.0.1", True), ("::ffff:169.254.169.254", True),  # IPv4-mapped
    ("64:ff9b::a9fe:a9fe", True),  # NAT64 to 169.254.169.254
    ("2002:a9fe:a9fe::1", True),  # 6to4 of 169.254.169.254
    ("8.8.8.8", False), ("1.1.1.1", False), ("2606:4700:4700::1111", False),
    ("::ffff:8.8.8.8", False), ("64:ff9b::808:808", False), ("2002:808:808::1", False),
])
def test_is_internal(address, internal):
    assert is_internal(ipaddress.ip_address(address)) is internal


@pytest.mark.parametrize(("host", "address"), [
    ("127.0.0.1", "127.0.0.1"), ("::1", "::1"), ("fd00:ec2::254", "fd00:ec2::254"),
    # shorthand IPv4 the resolver reads as an address
    ("127.1", "127.0.0.1"), ("2130706433", "127.0.0.1"), ("0x7f000001", "127.0.0.1"), ("0251.0376.0251.0376", "169.254.169.254"),
    ("hooks.slack.com", None), ("localhost", None), ("deadbeef", None), ("cafe.be", None), ("", None),
])
def test_literal_ip(host, address):
    got = literal_ip(host)
    assert (str(got) if got is not None else None) == address
