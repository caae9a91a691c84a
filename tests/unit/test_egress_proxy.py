"""corral's egress proxy's request rewriting: the destination always gets the host the
proxy checked, whatever Host header the sandbox sent, and a binding's value only there."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

import pytest

from corral.providers.egress.proxy import (
    ANY_HOST,
    LOG_FIELD_MAX,
    LOG_LINES_PER_S,
    Policy,
    RefusedError,
    Request,
    forbidden_destination,
    relay,
)

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


def test_a_placeholder_is_replaced_whole_never_as_the_start_of_a_longer_one() -> None:
    # TOK's placeholder begins TOK_RO's: replaced in turn, TOK_RO's value never went, but
    # TOK's with "_RO" after it; nor is a value that holds a placeholder replaced again.
    bindings = [
        BINDING,
        {"placeholder": "corral-secret-binding:TOK_RO", "value": "READ-ONLY", "header": None},
        {"placeholder": "corral-secret-binding:ECHO", "value": "corral-secret-binding:TOK"},
    ]
    request = Request(
        b"GET http://api.vendor.example/x HTTP/1.1\r\n"
        b"Authorization: Bearer corral-secret-binding:TOK_RO\r\n"
        b"X-Echo: corral-secret-binding:ECHO"
    )
    lines = request.origin_form(bindings).decode("latin-1").split("\r\n")
    assert "Authorization: Bearer READ-ONLY" in lines
    assert "X-Echo: corral-secret-binding:TOK" in lines


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
        "::127.0.0.1",  # IPv4-compatible
        "::ffff:0:7f00:1",  # SIIT
        "64:ff9b:1::a00:1",  # local-use NAT64
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


@pytest.mark.parametrize(
    "head",
    [
        b"GET http://a.example/ HTTP/1.1\r\nX-A: 1\nHost: internal.example",  # a bare LF
        b"GET http://a.example/ HTTP/1.1\r\nAuthorization: x\rHost: b",  # a bare CR
        b"GET\x0bHost:evil http://a.example/ HTTP/1.1",  # a control character in the method
        b"G(T http://a.example/ HTTP/1.1",  # a method that is not a token
        b"GET http://a.example/ HTTP/1.1\r\nBad Name: 1",  # a header name that is not a token
        b"GET http://a.example/ HTTP/1.1\r\nX-A: \x00",
    ],
)
def test_a_head_that_could_smuggle_a_line_past_the_checks_is_refused(head: bytes) -> None:
    with pytest.raises(RefusedError) as refused:
        Request(head)
    assert refused.value.status == 400


@pytest.mark.parametrize(
    "target", ["CONNECT a.example:0 HTTP/1.1", "GET http://a.example:0/ HTTP/1.1"]
)
def test_port_zero_is_refused_not_taken_for_the_default(target: str) -> None:
    with pytest.raises(RefusedError):
        Request(target.encode())


def test_the_log_stays_bounded_whatever_the_sandbox_makes_the_proxy_refuse(tmp_path: Path) -> None:
    log = tmp_path / "egress.log"
    policy = Policy({"rules": [], "log_path": str(log)})
    for _ in range(5_000):
        policy.log("egress_refused", reason="not in allowed_hosts", host="a" * 60_000, port=80)
    lines = log.read_text().splitlines()
    assert len(lines) <= LOG_LINES_PER_S * 2  # this second's, and perhaps the next's
    assert all(len(line) < LOG_FIELD_MAX + 200 for line in lines)


def test_a_tunnel_whose_client_reads_nothing_is_closed_after_the_idle_time() -> None:
    client, proxy_side = socket.socketpair()
    upstream_side, upstream = socket.socketpair()
    stop = threading.Event()

    def flood() -> None:  # the destination keeps sending; the client never reads
        upstream.settimeout(0.2)
        while not stop.is_set():
            with contextlib.suppress(OSError):
                upstream.send(b"x" * 65_536)

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    relaying = threading.Thread(target=relay, args=(proxy_side, upstream_side, 0.5), daemon=True)
    relaying.start()
    relaying.join(timeout=30)
    stop.set()
    sender.join()
    ended = not relaying.is_alive()
    for end in (client, proxy_side, upstream_side, upstream):
        end.close()
    assert ended, "a stalled send held the tunnel past its idle time"
