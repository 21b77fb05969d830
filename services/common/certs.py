"""The mesh's certificates: one local CA, and per service identity a key and a certificate it signs.

An identity is the certificate's common name: gateway, router, kvstore, worker, or client (operators'
tools: health checks, stats). Services present theirs to each other (mutual TLS) and check the peer's
name against what each RPC allows (services.common.rpc.require_peer). `meshserve up` mints a fresh set
per run in its log folder; `meshserve certs OUT_DIR --host NAME ...` mints one for a deployment, with
every host name or address the services are reached at in the certificates.

Files in a certificate folder: ca.pem, and <identity>.pem / <identity>-key.pem for each identity
(keys readable by the owner only).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

IDENTITIES = ("gateway", "router", "kvstore", "worker", "client", "supervisor", "autoscaler")
DEFAULT_HOSTS = ("127.0.0.1", "localhost")
VALID_DAYS = 825


def _write(path: Path, data: bytes, private: bool = False) -> None:
    path.write_bytes(data)
    if private:
        os.chmod(path, 0o600)


def _names(hosts) -> list:
    from cryptography import x509

    out = []
    for h in hosts:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            out.append(x509.DNSName(h))
    return out


def make_certs(out_dir: str | Path, hosts=DEFAULT_HOSTS, identities=IDENTITIES) -> Path:
    """A CA and a certificate per identity, valid for `hosts` (SANs), written to out_dir; returns it."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    pem = serialization.Encoding.PEM
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "meshserve mesh CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    _write(out / "ca.pem", ca.public_bytes(pem))
    for name in identities:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(start).not_valid_after(end)
                .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                      ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
                .sign(ca_key, hashes.SHA256()))
        _write(out / f"{name}.pem", cert.public_bytes(pem))
        _write(out / f"{name}-key.pem", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                         serialization.NoEncryption()), private=True)
    return out
