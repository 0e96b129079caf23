"""A throwaway PKI for the local cluster: one CA, the API server's serving certificate, client
certificates of the admin and the control-plane components, the service-account signing key,
and kubeconfigs that use them."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALID = datetime.timedelta(days=30)
# who each client certificate names (CN, O): the identities RBAC's bootstrap roles bind
CLIENTS = {
    "admin": ("kubernetes-admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", None),
    "scheduler": ("system:kube-scheduler", None),
    "kube-proxy": ("system:kube-proxy", None),
    "kubelet": ("system:node:localhost", "system:nodes"),
    "apiserver-kubelet-client": ("kube-apiserver-kubelet-client", "system:masters"),
}


@dataclass(frozen=True)
class Pki:
    dir: Path

    @property
    def ca(self) -> Path:
        return self.dir / "ca.crt"

    def cert(self, name: str) -> Path:
        return self.dir / f"{name}.crt"

    def key(self, name: str) -> Path:
        return self.dir / f"{name}.key"

    def kubeconfig(self, name: str) -> Path:
        return self.dir / f"{name}.kubeconfig"


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _name(cn: str, org: str | None = None) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.COMMON_NAME, cn)]
    if org:
        parts.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, org))
    return x509.Name(parts)


def _write_key(path: Path, key: rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _issue(
    subject: x509.Name,
    key: rsa.RSAPrivateKey,
    issuer: x509.Name,
    issuer_key: rsa.RSAPrivateKey,
    *,
    ca: bool = False,
    usage: x509.ObjectIdentifier | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + VALID)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    return builder.sign(issuer_key, hashes.SHA256())


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_pki(directory: Path, server: str, server_ips: list[str]) -> Pki:
    """Every key, certificate and kubeconfig the cluster needs, under `directory`; `server` is
    the API server's URL and `server_ips` the addresses its certificate names."""
    pki = Pki(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_name = _key(), _name("skiff-localkube-ca")
    _write_key(directory / "ca.key", ca_key)
    _write_cert(pki.ca, _issue(ca_name, ca_key, ca_name, ca_key, ca=True))

    dns = ["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"]
    dns.append("kubernetes.default.svc.cluster.local")
    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in server_ips]
    _serving(pki, "apiserver", "kube-apiserver", sans, ca_name, ca_key)
    # the kubelet serves logs, exec and port-forward to the API server at its node name
    kubelet_sans: list[x509.GeneralName] = [x509.DNSName("localhost")]
    kubelet_sans.append(x509.IPAddress(ipaddress.ip_address("127.0.0.1")))
    _serving(pki, "kubelet-serving", "localhost", kubelet_sans, ca_name, ca_key)

    for client, (cn, org) in CLIENTS.items():
        key = _key()
        _write_key(pki.key(client), key)
        cert = _issue(_name(cn, org), key, ca_name, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        _write_cert(pki.cert(client), cert)
        _write_kubeconfig(pki, client, server)

    sa_key = _key()
    _write_key(directory / "sa.key", sa_key)
    (directory / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def _serving(
    pki: Pki,
    name: str,
    cn: str,
    sans: list[x509.GeneralName],
    ca_name: x509.Name,
    ca_key: rsa.RSAPrivateKey,
) -> None:
    """A serving certificate `name` for the DNS names and addresses `sans`."""
    key = _key()
    _write_key(pki.key(name), key)
    cert = _issue(_name(cn), key, ca_name, ca_key, usage=ExtendedKeyUsageOID.SERVER_AUTH, sans=sans)
    _write_cert(pki.cert(name), cert)


def _write_kubeconfig(pki: Pki, user: str, server: str) -> None:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "local", "cluster": {"server": server, "certificate-authority": str(pki.ca)}}
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(pki.cert(user)),
                    "client-key": str(pki.key(user)),
                },
            }
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    pki.kubeconfig(user).write_text(yaml.safe_dump(config))
