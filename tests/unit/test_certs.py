"""`meshserve certs`: a CA and a certificate per identity, private keys owner-only, never over an existing set."""

import argparse
import stat

from cryptography import x509

from services.cli import cmd_certs
from services.common.certs import IDENTITIES


def test_certs_for_a_deployment(tmp_path, capsys):
    out = tmp_path / "tls"
    assert cmd_certs(argparse.Namespace(out_dir=str(out), host=["decode-1.mesh"])) == 0
    ca = x509.load_pem_x509_certificate((out / "ca.pem").read_bytes())
    for name in IDENTITIES:
        cert = x509.load_pem_x509_certificate((out / f"{name}.pem").read_bytes())
        assert cert.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value == name
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert "decode-1.mesh" in sans.get_values_for_type(x509.DNSName)
        assert stat.S_IMODE((out / f"{name}-key.pem").stat().st_mode) == 0o600
    assert cmd_certs(argparse.Namespace(out_dir=str(out), host=[])) == 2  # never overwrites a mesh's set
    assert "not empty" in capsys.readouterr().err
