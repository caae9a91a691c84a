"""corral's egress proxy's request rewriting: the destination always gets the host the
proxy checked, whatever Host header the sandbox sent, and a binding's value only there."""

from __future__ import annotations

import pytest

from corral.providers.egress_proxy import ANY_HOST, Policy, Request, forbidden_destination

BINDING = {"placeholder": "corral-secret-binding:TOK", "value": "REAL", "header": None}


def _sent(head: str) -> str:
    request = Request(head.replace("\n", "\r\n").encode("latin-1"))
    return request.origin_form([BINDING]).decode("latin-1")


def test_the_clients_host_header_is_replaced_by_the_checked_authority() -> None:
    sent = _sent(
        "GET http://api.vendor.example/x HTTP/1.1\n"
        "Host: attacker.example\n"
        "HOST: second.example\n"
        "Authorization: Bearer corral-secret-binding:TOK"
    )
    lines = sent.split("\r\n")
    assert [line for line in lines if line.lower().startswith("host:")] == [
        "Host: api.vendor.example"
    ]
    assert "attacker.example" not in sent and "second.example" not in sent
    assert "Authorization: Bearer REAL" in lines


def test_a_port_and_an_ipv6_address_are_kept_in_the_host_header() -> None:
    assert "Host: 127.0.0.1:8080" in _sent("GET http://127.0.0.1:8080/ HTTP/1.1\nHost: x")
    assert "Host: [::1]:9" in _sent("GET http://[::1]:9/ HTTP/1.1\nHost: x")


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",  # a cloud's metadata service
        "::ffff:169.254.169.254",
        "fe80::1%eth0",
        "127.0.0.1",
        "127.1.2.3",
        "0.0.0.0",
        "::",
        "::1",
        "10.0.0.7",
        "172.16.5.4",
        "192.168.1.1",
        "100.64.0.1",  # shared address space (CGNAT)
        "fd00::1",  # unique local
        "224.0.0.1",
        "ff02::1",
        "240.0.0.1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:10.0.0.1",
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "2001:db8::1",  # documentation
    ],
)
def test_closed_addresses_are_refused_whatever_the_allowed_hosts(address: str) -> None:
    assert forbidden_destination(address)
    policy = Policy({"rules": [{"host": ANY_HOST, "port": None}]})
    assert not policy.is_open(address, 443)


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"])
def test_global_addresses_are_open(address: str) -> None:
    assert not forbidden_destination(address)


def test_only_what_the_deployment_opened_is_open_among_closed_addresses() -> None:
    policy = Policy(
        {
            "rules": [{"host": ANY_HOST, "port": None}],
            "open_networks": [
                {"host": "10.1.0.0/16", "port": 443},
                {"host": "127.0.0.1", "port": None},
            ],
        }
    )
    assert policy.is_open("10.1.2.3", 443)
    assert not policy.is_open("10.1.2.3", 80)
    assert not policy.is_open("10.2.0.1", 443)
    assert policy.is_open("127.0.0.1", 6379)
    assert not policy.is_open("127.0.0.2", 6379)
