"""corral's egress proxy's request rewriting: the destination always gets the host the
proxy checked, whatever Host header the sandbox sent, and a binding's value only there."""

from __future__ import annotations

from corral.providers.egress_proxy import Request, forbidden_destination

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


def test_link_local_destinations_are_refused_whatever_the_allowed_hosts() -> None:
    assert forbidden_destination("169.254.169.254")  # a cloud's metadata service
    assert forbidden_destination("::ffff:169.254.169.254")
    assert forbidden_destination("fe80::1%eth0")
    assert not forbidden_destination("127.0.0.1")
    assert not forbidden_destination("10.0.0.7")
    assert not forbidden_destination("2001:db8::1")
