"""Ed25519 identities of workers and of the coordinator, kept in a private key file.

Every control-plane request is signed by its sender, and the worker id
is derived from the public key, so an id cannot be claimed without the key: the
coordinator recomputes `worker_id_of(public_key)` from the envelope and never trusts an id
sent as data. The private key lives in a file created atomically with mode 0600
(`O_CREAT | O_EXCL`, so two processes racing to create it cannot both win and no other
user ever sees a readable file), and a key file readable by group or others is refused,
as OpenSSH refuses an unprotected private key.

Signing and verifying use libsodium (PyNaCl): on this project's machines it verifies in
about half the time of OpenSSL (58 vs 114 us), and the coordinator verifies every
request. `cryptography` still checks that a public key is a valid curve point, once per
key (cached), so a malformed key is told apart from a bad signature.
"""

from __future__ import annotations

import hashlib
import os
import stat
from functools import lru_cache
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from nacl.bindings import crypto_sign_open
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64
WORKER_ID_PREFIX = "w"
WORKER_ID_HEX = 20  # 80 bits of sha256(public key): collisions need ~2^40 keys
WORKER_ID_LEN = len(WORKER_ID_PREFIX) + WORKER_ID_HEX


class IdentityError(Exception):
    """A key file is missing, malformed or unsafe; the message says which and why."""


class KeyFilePermissionError(IdentityError):
    """The key file is readable or writable by group/others (or is not a regular file)."""


def worker_id_of(public_key: bytes) -> str:
    """Worker id of a raw 32-byte Ed25519 public key: "w" + 20 hex of sha256(key)."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return _worker_id(bytes(public_key))


@lru_cache(maxsize=65536)  # every request recomputes its sender's id: the same few thousand keys
def _worker_id(public_key: bytes) -> str:
    return WORKER_ID_PREFIX + hashlib.sha256(public_key).hexdigest()[:WORKER_ID_HEX]


class InvalidSignature(Exception):
    """The signature does not verify over the data with the public key."""


@lru_cache(maxsize=65536)
def _checked_key(public_key: bytes) -> bytes:
    # Checking the point costs about as much as hashing it; the coordinator sees the same
    # few thousand keys over and over, so keep the checked keys (bounded LRU). The cache
    # holds the raw bytes only, not key objects: bytes are invisible to the cyclic garbage
    # collector, while two objects per worker (the wrapper and PyNaCl's VerifyKey) made
    # up a third of what a full collection walked at 10k workers.
    Ed25519PublicKey.from_public_bytes(public_key)  # ValueError: not a valid point
    return public_key


class PublicKey:
    """A checked Ed25519 public key; `verify` raises InvalidSignature."""

    __slots__ = ("_key",)

    def __init__(self, key: bytes) -> None:
        self._key = key  # 32 raw bytes, already checked to be a valid point

    def verify(self, signature: bytes, data: bytes) -> None:
        # what PyNaCl's VerifyKey.verify does, without its encoder indirection
        try:
            crypto_sign_open(signature + data, self._key)
        except BadSignatureError:
            raise InvalidSignature("signature does not verify") from None


def load_public_key(public_key: bytes) -> PublicKey:
    """Checked (cached) Ed25519 public key; ValueError if not 32 bytes or not a valid point."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"public key must be {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}")
    return PublicKey(_checked_key(bytes(public_key)))


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> bool:
    """True iff `signature` is a valid Ed25519 signature of exactly `data` by `public_key`."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        load_public_key(public_key).verify(signature, data)
    except (InvalidSignature, ValueError):
        return False
    return True


class Identity:
    """An Ed25519 key pair: sign bytes, export the raw public key, derive the worker id."""

    __slots__ = ("_private", "public_key", "worker_id")

    def __init__(self, private_key: SigningKey) -> None:
        self._private = private_key
        self.public_key: bytes = bytes(private_key.verify_key)
        self.worker_id: str = worker_id_of(self.public_key)

    @classmethod
    def generate(cls) -> Identity:
        """A fresh random identity (kept in memory only)."""
        return cls(SigningKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> Identity:
        """Identity from a raw 32-byte Ed25519 private key (seed)."""
        if len(raw) != 32:
            raise IdentityError(f"an Ed25519 private key is 32 bytes, got {len(raw)}")
        return cls(SigningKey(bytes(raw)))

    def private_bytes(self) -> bytes:
        """The raw 32-byte private key (seed). Handle with care: this is the secret."""
        return bytes(self._private)

    def sign(self, data: bytes) -> bytes:
        """64-byte Ed25519 signature of exactly `data`."""
        return self._private.sign(data).signature

    def verify(self, signature: bytes, data: bytes) -> bool:
        return verify_signature(self.public_key, signature, data)

    # ------------------------------------------------------------------ files

    def save(self, path: str | Path) -> None:
        """Write the key to a new file with mode 0600; FileExistsError if it exists.

        The file is created with O_CREAT|O_EXCL and mode 0o600 in one call, so it is never
        visible with looser permissions and two racing writers cannot both succeed.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask can only remove bits, but be explicit
            data = self.private_bytes()
            written = 0
            while written < len(data):
                written += os.write(fd, data[written:])
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        # Make the new directory entry durable too: a worker that lost its key in a crash
        # would come back under another worker id.
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """Load a key written by `save`; refuse a file that group/others may read or write."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            raise IdentityError(f"key file {path} does not exist") from None
        except OSError as e:
            raise IdentityError(f"cannot open key file {path}: {e.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KeyFilePermissionError(f"key file {path} is not a regular file")
            if st.st_mode & 0o077:
                raise KeyFilePermissionError(
                    f"key file {path} has mode {stat.S_IMODE(st.st_mode):04o}; it must not be "
                    f"accessible by group or others (run: chmod 600 {path})"
                )
            if st.st_uid != os.getuid():
                raise KeyFilePermissionError(f"key file {path} is owned by another user (uid {st.st_uid})")
            data = os.read(fd, 65)
        finally:
            os.close(fd)
        if len(data) != 32:
            raise IdentityError(f"key file {path} is malformed: expected 32 bytes, found {len(data)}")
        return cls.from_private_bytes(data)

    @classmethod
    def load_or_create(cls, path: str | Path) -> Identity:
        """Load the key at `path`, or create it (mode 0600) if it does not exist yet."""
        path = Path(path)
        if not path.exists() and not path.is_symlink():
            identity = cls.generate()
            try:
                identity.save(path)
                return identity
            except FileExistsError:
                pass  # another process created it first: use theirs
        return cls.load(path)

    def __repr__(self) -> str:
        return f"Identity({self.worker_id})"
