"""What a dispatch's ``egress.allowed_hosts`` entries mean, in one place.

An entry is a host name (``pypi.org``), an IP address (``10.0.0.7``, ``[::1]``) or a network
in CIDR notation (``10.0.0.0/8``), each optionally with a port (``pypi.org:443``,
``[::1]:8080``). Without a port every port of the host is allowed. Host names are matched
exactly (no wildcards), case-insensitively. The message validates entries with
:func:`parse_host_rule`; providers turn the parsed rules into what they enforce (corral's
egress proxy, a NetworkPolicy, a vendor's allow-list).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

from corral.providers.errors import InvalidProviderConfigError

MAX_HOST_ENTRY = 261  # 253 for a name, a colon and a port
_LABEL = r"(?!-)[a-z0-9-]{1,63}(?<!-)"
_HOST_NAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*\.?$")
_PORT = re.compile(r"^[0-9]{1,5}$")


@dataclass(frozen=True)
class HostRule:
    """One allowed destination: a name or an address or network, and a port or any."""

    host: str  # a lower-case name, an address, or a network in CIDR notation
    port: int | None = None

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
        """The address or network this rule names, or None for a host name."""
        try:
            return ipaddress.ip_network(self.host, strict=False)
        except ValueError:
            return None

    @property
    def is_name(self) -> bool:
        return self.network is None

    def as_json(self) -> dict[str, object]:
        return {"host": self.host, "port": self.port}

    def __str__(self) -> str:
        shown = f"[{self.host}]" if ":" in self.host else self.host
        return shown if self.port is None else f"{shown}:{self.port}"


def parse_host_rule(entry: str) -> HostRule:
    """The rule of one ``allowed_hosts`` entry.

    Raises:
        ValueError: not a host name, address or CIDR network with an optional port; the
            message says what is accepted (never quoting the entry).
    """
    text = entry.strip().lower()
    if not text or len(text) > MAX_HOST_ENTRY:
        raise ValueError(f"must be 1-{MAX_HOST_ENTRY} characters")
    host, port = _split_port(text)
    if _HOST_NAME.match(host) and not _all_digits_and_dots(host):
        return HostRule(host.rstrip("."), port)
    try:
        network = ipaddress.ip_network(host, strict=True)
    except ValueError:
        raise ValueError(
            "must be a host name, an IP address or a CIDR network, optionally with :port "
            "(e.g. pypi.org, pypi.org:443, 10.0.0.0/8, [::1]:8080)"
        ) from None
    if network.num_addresses == 1:
        return HostRule(str(network.network_address), port)
    return HostRule(str(network), port)


def _split_port(text: str) -> tuple[str, int | None]:
    if text.startswith("["):  # [v6] or [v6]:port
        close = text.find("]")
        if close < 0:
            raise ValueError("an IPv6 address in brackets needs its closing bracket")
        rest = text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError("after an IPv6 address in brackets only :port may follow")
        return text[1:close], _port(rest[1:]) if rest else None
    if text.count(":") == 1:
        host, port = text.split(":")
        return host, _port(port)
    return text, None  # a name, v4, or a bare v6 address without a port


def _port(text: str) -> int:
    if not _PORT.match(text) or not 1 <= int(text) <= 65535:
        raise ValueError("a port must be a number from 1 to 65535")
    return int(text)


def _all_digits_and_dots(host: str) -> bool:
    return all(c.isdigit() or c == "." for c in host)


def parse_host_rules(entries: tuple[str, ...] | list[str]) -> tuple[HostRule, ...]:
    """The rules of every entry, in order, without repeats.

    Raises:
        ValueError: as :func:`parse_host_rule`.
    """
    rules: list[HostRule] = []
    for entry in entries:
        rule = parse_host_rule(entry)
        if rule not in rules:
            rules.append(rule)
    return tuple(rules)


def vendor_allow_list(hosts: tuple[str, ...], vendor: str) -> tuple[list[str], list[str]]:
    """The host names and the networks (CIDR) of ``hosts``, for a vendor whose egress
    allow-list has no ports.

    Raises:
        InvalidProviderConfigError: an entry has a port, which the vendor cannot enforce.
    """
    rules = parse_host_rules(hosts)
    if any(rule.port is not None for rule in rules):
        raise InvalidProviderConfigError(
            f"{vendor} restricts egress by host, not by port: give egress.allowed_hosts "
            "without ports for this provider, or route the item to local, docker or kubernetes"
        )
    names = [rule.host for rule in rules if rule.is_name]
    networks = [str(rule.network) for rule in rules if not rule.is_name]
    return names, networks
