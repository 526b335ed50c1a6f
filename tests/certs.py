"""Real X.509 certificates for the TLS tests, made with the `cryptography` package: a CA,
a server certificate for localhost / 127.0.0.1 signed by it, and a client certificate."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certs:
    """PEM files: ca (the CA's certificate), server_cert/server_key, client_cert/client_key."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> Path:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return path


def _issue(
    subject: str,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usage: x509.ObjectIdentifier | None = None,
    hosts: tuple[str, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path, hosts: tuple[str, ...] = ("localhost", "127.0.0.1")) -> Certs:
    """A CA and the certificates it signs, written under directory."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("tierps test CA", ca_key, _name("tierps test CA"), ca_key, ca=True)
    files = {}
    for who, usage, names in (
        ("server", ExtendedKeyUsageOID.SERVER_AUTH, hosts),
        ("client", ExtendedKeyUsageOID.CLIENT_AUTH, ()),
    ):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _issue(f"tierps {who}", key, ca_cert.subject, ca_key, usage=usage, hosts=names)
        files[f"{who}_cert"] = directory / f"{who}.pem"
        files[f"{who}_cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        files[f"{who}_key"] = _write_key(key, directory / f"{who}-key.pem")
    ca = directory / "ca.pem"
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    return Certs(ca=ca, **files)
