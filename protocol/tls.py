"""TLS for the coordinator's gRPC port, authenticated by a pinned certificate fingerprint.

The coordinator serves gRPC over TLS with either the operator's certificate
(`--tls-cert/--tls-key`) or a self-signed one generated once into its data dir
(`tls.crt`, `tls.key` with mode 0600, ECDSA P-256, valid for ten years) and reused on
every restart, so its fingerprint stays the same. The fingerprint is the sha256 of the
leaf certificate's DER bytes, in lowercase hex. It travels in the coordinator's signed DHT
record and in the join string, so a worker knows it from the join string alone and needs
no certificate authority.

How a worker pins it (`pinned_credentials`): it opens a plain TLS connection to the
endpoint without verifying anything, reads the leaf certificate the server presents and
compares its fingerprint with the pinned one; a mismatch (or a server that does not speak
TLS) raises before any gRPC channel exists, so no request is ever sent to the wrong
server. On a match the channel is built with that very certificate as its only trust root
and its own name (`grpc.ssl_target_name_override`), so gRPC's handshake verifies that the
server holds the certificate's private key, and every later (re)connection must present a
certificate that chains to it: nothing else is trusted, whatever the probe saw.

A CA-signed certificate given with `--tls-cert` is handled the same way: the worker pins
the leaf, not the CA, and BoringSSL accepts a leaf that is itself a trust root (a partial
chain). The CA plays no part for workers, and renewing the certificate changes the
fingerprint: join strings carrying the old one stop working (the worker says so), which is
what pinning means. The server name checked is the endpoint's host when the certificate
names it, else the certificate's first DNS name, else the endpoint's host.
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import os
import socket
import ssl
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from bagel.protocol.atomicfile import atomic_write

TLS_CERT_FILE = "tls.crt"
TLS_KEY_FILE = "tls.key"
SELF_SIGNED_NAME = "bagel-coordinator"  # the DNS name in a generated certificate
SELF_SIGNED_DAYS = 3650
MAX_PEM_BYTES = 256 * 1024
FINGERPRINT_HEX_CHARS = 64
DEFAULT_PROBE_TIMEOUT_S = 10.0


class TLSError(Exception):
    """TLS cannot be set up: a bad certificate or key file, or a server that does not speak TLS."""


class FingerprintMismatch(TLSError):
    """The server presented a certificate whose sha256 is not the pinned fingerprint."""


def fingerprint(cert_der: bytes) -> str:
    """sha256 of a certificate's DER bytes, lowercase hex (64 characters)."""
    return hashlib.sha256(cert_der).hexdigest()


def check_fingerprint(text: str) -> str:
    """`text` as a normalised fingerprint (lowercase hex, colons allowed); TLSError if malformed."""
    norm = text.strip().replace(":", "").lower()
    if len(norm) != FINGERPRINT_HEX_CHARS or any(c not in "0123456789abcdef" for c in norm):
        raise TLSError(f"a TLS fingerprint is {FINGERPRINT_HEX_CHARS} hex digits (sha256), got {text[:80]!r}")
    return norm


@dataclass(frozen=True)
class ServerCertificate:
    """What the coordinator serves with: PEM chain and key, and the leaf's fingerprint."""

    chain_pem: bytes
    key_pem: bytes
    fingerprint: str

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key_pem, self.chain_pem)])


def _read_bounded(path: Path, what: str) -> bytes:
    try:
        with path.open("rb") as f:
            data = f.read(MAX_PEM_BYTES + 1)
    except OSError as e:
        raise TLSError(f"cannot read the TLS {what} {path}: {e.strerror or e}") from None
    if len(data) > MAX_PEM_BYTES:
        raise TLSError(f"the TLS {what} {path} is larger than {MAX_PEM_BYTES} bytes")
    return data


def load_server_certificate(cert_path: Path, key_path: Path) -> ServerCertificate:
    """Load a PEM certificate chain (leaf first) and its private key; TLSError says what is wrong."""
    chain_pem = _read_bounded(cert_path, "certificate")
    key_pem = _read_bounded(key_path, "key")
    try:
        certs = x509.load_pem_x509_certificates(chain_pem)
    except ValueError as e:
        raise TLSError(f"{cert_path} holds no PEM certificate: {e}") from None
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as e:
        raise TLSError(f"{key_path} is not an unencrypted PEM private key: {e}") from None
    leaf = certs[0]
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, raw) != leaf.public_key().public_bytes(
        serialization.Encoding.DER, raw
    ):
        raise TLSError(f"the key in {key_path} does not belong to the first certificate in {cert_path}")
    return ServerCertificate(chain_pem, key_pem, fingerprint(leaf.public_bytes(serialization.Encoding.DER)))


def _self_signed(key: ec.EllipticCurvePrivateKey, now: datetime.datetime) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SELF_SIGNED_NAME)])
    return (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=SELF_SIGNED_DAYS))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(SELF_SIGNED_NAME)]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )


def _check_private_file(path: Path) -> None:
    st = path.lstat()
    if not stat.S_ISREG(st.st_mode):
        raise TLSError(f"{path} is not a regular file")
    if st.st_mode & 0o077:
        raise TLSError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be accessible by group or others "
            f"(run: chmod 600 {path})"
        )


def load_or_create_self_signed(data_dir: Path, *, now: datetime.datetime | None = None) -> ServerCertificate:
    """The data dir's self-signed certificate, generated on first use and reused afterwards.

    The key is written first (mode 0600, atomically), then the certificate. A data dir with
    a key but no certificate (a crash between the two writes, before anything was
    published) gets a new certificate for that key; a certificate without its key is an
    error, never silently replaced, because replacing it would change the fingerprint.
    """
    cert_path, key_path = data_dir / TLS_CERT_FILE, data_dir / TLS_KEY_FILE
    if cert_path.exists() and not key_path.exists():
        raise TLSError(f"{cert_path} exists but its key {key_path} is missing; restore it or remove both")
    if not key_path.exists():
        key = ec.generate_private_key(ec.SECP256R1())
        atomic_write(
            key_path,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
        )  # mkstemp creates the temporary file with mode 0600
        os.chmod(key_path, 0o600)
    _check_private_file(key_path)
    if not cert_path.exists():
        loaded = serialization.load_pem_private_key(_read_bounded(key_path, "key"), password=None)
        if not isinstance(loaded, ec.EllipticCurvePrivateKey):
            raise TLSError(f"{key_path} is not an ECDSA key")
        stamp = now or datetime.datetime.now(datetime.UTC)
        atomic_write(cert_path, _self_signed(loaded, stamp).public_bytes(serialization.Encoding.PEM))
    return load_server_certificate(cert_path, key_path)


# ---------------------------------------------------------------------------- the worker's side


def split_target(target: str) -> tuple[str, int]:
    """("host", port) of a gRPC target "host:port" or "[v6]:port"; TLSError if malformed."""
    host, sep, port_s = target.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise TLSError(f"not a host:port target: {target[:80]!r}")
    return host, int(port_s)


def fetch_certificate(target: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> bytes:
    """The DER leaf certificate the server at `target` presents (nothing verified). Blocking.

    TLSError if the server answers the handshake with something that is not TLS (a
    plaintext gRPC server answers a ClientHello with HTTP/2 bytes); OSError if it cannot
    be reached or the connection is cut (refused, reset, timed out: worth retrying).
    """
    host, port = split_target(target)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE  # on purpose: the fingerprint check below is the verification
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        try:
            with ctx.wrap_socket(sock, server_hostname=None if _is_ip(host) else host) as tls:
                der = tls.getpeercert(binary_form=True)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError) as e:  # cut off mid-handshake: maybe a restart
            raise ConnectionResetError(f"{target} closed the connection during the TLS handshake ({e})") from None
        except ssl.SSLError as e:  # e.g. WRONG_VERSION_NUMBER: a plaintext server answered
            raise TLSError(f"{target} does not speak TLS ({e.reason or e})") from None
    if not der:
        raise TLSError(f"{target} presented no certificate")
    return der


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def server_name_for(cert: x509.Certificate, host: str) -> str:
    """The name gRPC checks the certificate against (see the module docstring)."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return host
    names = [str(n) for n in san.get_values_for_type(x509.DNSName)]
    if host in names:
        return host
    return names[0] if names else host


@dataclass(frozen=True)
class PinnedTLS:
    """Channel credentials trusting exactly one certificate, and the name to check it by."""

    certificate_pem: bytes
    server_name: str
    fingerprint: str

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.certificate_pem)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]


def pinned_credentials(target: str, pinned: str, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> PinnedTLS:
    """Check the certificate at `target` against the `pinned` fingerprint; blocking.

    FingerprintMismatch if the server presents another certificate, TLSError if it does
    not speak TLS, OSError if it cannot be reached; nothing is sent beyond the handshake.
    """
    want = check_fingerprint(pinned)
    der = fetch_certificate(target, timeout_s)
    got = fingerprint(der)
    if got != want:
        raise FingerprintMismatch(
            f"{target} presents a TLS certificate with sha256 {got}, not the pinned {want}: refusing to connect"
        )
    cert = x509.load_der_x509_certificate(der)
    host, _ = split_target(target)
    return PinnedTLS(cert.public_bytes(serialization.Encoding.PEM), server_name_for(cert, host), want)


__all__ = [
    "TLS_CERT_FILE",
    "TLS_KEY_FILE",
    "FingerprintMismatch",
    "PinnedTLS",
    "ServerCertificate",
    "TLSError",
    "check_fingerprint",
    "fetch_certificate",
    "fingerprint",
    "load_or_create_self_signed",
    "load_server_certificate",
    "pinned_credentials",
]
