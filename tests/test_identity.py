"""Identity key files: created 0600 atomically, refused when others can read them."""

from __future__ import annotations

import os
import stat

import pytest

from bagel.protocol.identity import (
    Identity,
    IdentityError,
    KeyFilePermissionError,
    verify_signature,
    worker_id_of,
)


def test_create_writes_mode_0600_and_reloads_same_key(tmp_path):
    path = tmp_path / "keys" / "worker.key"
    first = Identity.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    second = Identity.load_or_create(path)
    assert second.public_key == first.public_key
    assert second.worker_id == first.worker_id


def test_mode_is_0600_even_with_a_permissive_umask(tmp_path):
    old = os.umask(0)
    try:
        Identity.generate().save(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600


def test_save_never_overwrites(tmp_path):
    path = tmp_path / "k"
    Identity.generate().save(path)
    with pytest.raises(FileExistsError):
        Identity.generate().save(path)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_refuses_key_readable_by_others(tmp_path, mode):
    path = tmp_path / "k"
    Identity.generate().save(path)
    path.chmod(mode)
    with pytest.raises(KeyFilePermissionError, match="chmod 600"):
        Identity.load(path)
    with pytest.raises(KeyFilePermissionError):
        Identity.load_or_create(path)


def test_refuses_symlink_and_malformed_file(tmp_path):
    real = tmp_path / "real"
    Identity.generate().save(real)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(IdentityError):
        Identity.load(link)
    bad = tmp_path / "bad"
    fd = os.open(bad, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"short")
    os.close(fd)
    with pytest.raises(IdentityError, match="malformed"):
        Identity.load(bad)
    with pytest.raises(IdentityError, match="does not exist"):
        Identity.load(tmp_path / "missing")


def test_worker_id_derived_from_public_key():
    a, b = Identity.generate(), Identity.generate()
    assert a.worker_id == worker_id_of(a.public_key)
    assert a.worker_id != b.worker_id
    assert a.worker_id.startswith("w") and len(a.worker_id) == 21
    assert len(a.public_key) == 32


def test_sign_and_verify():
    ident = Identity.generate()
    sig = ident.sign(b"payload")
    assert len(sig) == 64
    assert verify_signature(ident.public_key, sig, b"payload")
    assert not verify_signature(ident.public_key, sig, b"payloaD")
    assert not verify_signature(Identity.generate().public_key, sig, b"payload")
    assert not verify_signature(ident.public_key, sig[:63], b"payload")
    assert not verify_signature(ident.public_key[:31], sig, b"payload")
