"""A throwaway PKI for TLS tests: a CA and leaf certificates (EC P-256, one day) for given hosts,
valid for server and client authentication. Needs the `cryptography` package."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from splitserve.config import ConnectorConfig


@dataclass(frozen=True)
class Pki:
    cert: str
    key: str
    ca: str

    def config(self) -> ConnectorConfig:
        return ConnectorConfig(tls_cert=self.cert, tls_key=self.key, tls_ca=self.ca)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return str(path)


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Certificate | None,
          issuer_key: ec.EllipticCurvePrivateKey, hosts: tuple[str, ...]) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    b = (x509.CertificateBuilder().subject_name(name)
         .issuer_name(issuer.subject if issuer else name).public_key(key.public_key())
         .serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1)))
    if issuer is None:  # the CA
        b = b.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        b = b.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False,
                                          False), critical=True)
        b = b.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
    else:
        sans: list[x509.GeneralName] = []
        for h in hosts:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(h)))
            except ValueError:
                sans.append(x509.DNSName(h))
        b = (b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.SubjectAlternativeName(sans), critical=False)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                   ExtendedKeyUsageOID.CLIENT_AUTH]), False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
                 issuer_key.public_key()), False))
    return b.sign(issuer_key, hashes.SHA256())


def make_pki(root: Path, name: str, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
             ca_from: tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate] | None = None
             ) -> tuple[Pki, tuple[Path, ec.EllipticCurvePrivateKey, x509.Certificate]]:
    """A CA (or `ca_from`) and a leaf certificate for `hosts` signed by it."""
    root.mkdir(parents=True, exist_ok=True)
    if ca_from is None:
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert(f"{name} CA", ca_key, None, ca_key, ())
        ca_path = root / f"{name}-ca.pem"
        ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        ca_from = (ca_path, ca_key, ca_cert)
    ca_path, ca_key, ca_cert = ca_from
    key = ec.generate_private_key(ec.SECP256R1())
    cert = root / f"{name}.pem"
    cert.write_bytes(_cert(name, key, ca_cert, ca_key, hosts).public_bytes(
        serialization.Encoding.PEM))
    return Pki(str(cert), _write_key(root / f"{name}.key", key), str(ca_path)), ca_from
