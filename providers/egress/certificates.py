"""The certificates corral's egress proxy terminates a bound host's TLS with, made by the
provider worker for one sandbox: a CA of its own (a fresh key, valid for the sandbox's life,
constrained to the bound hosts by name constraints) and one certificate per bound host
signed by it. The CA's key signs them and is discarded; the sandbox trusts the CA's
certificate alone, the proxy gets the hosts' certificates and keys on its stdin.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CLOCK_SKEW = timedelta(minutes=5)  # a sandbox's clock a little behind the worker's
_NOWHERE = "corral.invalid"  # the names a CA for addresses alone may sign (none: .invalid)
_ANY_V4 = ipaddress.ip_network("0.0.0.0/0")
_ANY_V6 = ipaddress.ip_network("::/0")


@dataclass(frozen=True)
class HostCertificate:
    """What the proxy shows the sandbox for one bound host."""

    host: str  # a lower-case name or an address, as the proxy matches it
    cert_pem: str
    key_pem: str = field(repr=False)


@dataclass(frozen=True)
class SandboxCertificates:
    """One sandbox's CA certificate (for its trust store) and its hosts' certificates."""

    ca_pem: str
    hosts: tuple[HostCertificate, ...]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _general_name(host: str) -> x509.GeneralName:
    address = _address(host)
    return x509.DNSName(host) if address is None else x509.IPAddress(address)


def _constraints(hosts: list[str]) -> x509.NameConstraints:
    """Names the CA may sign for: the bound hosts alone. A kind of name without a subtree
    would not be constrained at all, so a kind no bound host has is shut: addresses
    excluded whole, names limited to a reserved domain."""
    names: list[x509.GeneralName] = [x509.DNSName(h) for h in hosts if _address(h) is None]
    networks: list[x509.GeneralName] = [
        x509.IPAddress(ipaddress.ip_network(h)) for h in hosts if _address(h) is not None
    ]
    excluded: list[x509.GeneralName] = [x509.IPAddress(_ANY_V4), x509.IPAddress(_ANY_V6)]
    return x509.NameConstraints(
        permitted_subtrees=(names or [x509.DNSName(_NOWHERE)]) + networks,
        excluded_subtrees=None if networks else excluded,
    )


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def sandbox_certificates(hosts: Iterable[str], *, valid_s: float) -> SandboxCertificates:
    """A fresh CA for one sandbox, valid ``valid_s`` seconds from now, and a certificate
    for each of ``hosts`` (names or single addresses) signed by it.

    Raises:
        ValueError: no host, or one that is neither a name nor an address.
    """
    wanted = sorted(set(hosts))
    if not wanted:
        raise ValueError("certificates for no host")
    now = datetime.now(UTC)
    start, end = now - CLOCK_SKEW, now + timedelta(seconds=valid_s)
    ca_key = _key()  # signs below, then goes with this frame
    ca_name = _name("corral egress proxy, one sandbox")
    ca_id = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(signs=True), critical=True)
        .add_extension(_constraints(wanted), critical=True)
        .add_extension(ca_id, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    made = []
    for host in wanted:
        key = _key()
        cert = (
            x509.CertificateBuilder()
            # No subject: GnuTLS (git's TLS on Debian) checks a subject's common name
            # against the CA's name constraints, as a host name; the SAN alone names it.
            .subject_name(x509.Name([]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(signs=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.SubjectAlternativeName([_general_name(host)]), critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_id),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        made.append(HostCertificate(host, _pem(cert), _key_pem(key)))
    return SandboxCertificates(_pem(ca), tuple(made))


def _usage(*, signs: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs,
        crl_sign=signs,
        encipher_only=False,
        decipher_only=False,
    )


def _pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def _key_pem(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode("ascii")
