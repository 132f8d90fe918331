"""Hashcash-style proof of work for a registration: the cost of one identity.

An open run lets anyone register, so an identity must cost something, or one process
registers thousands (Back, "Hashcash - a denial of service counter-measure", 2002; the
same leading-zero-bits test). The work is bound to what it buys:

    digest = sha256(b"bagel-pow1" | challenge | run_id | public_key | nonce as 8 bytes LE)

and it is valid when `digest` starts with `bits` zero bits. `challenge` comes from the
coordinator (`AdmissionChallenge`) and changes every few minutes, so work cannot be done
in advance for many identities and kept; the public key is the registering worker's, so
one solution admits one identity; the run id keeps another run's work out. Solving takes
about 2^bits hashes, checking takes one.

Pure: no clock, no randomness (the solver counts nonces up from `start`).
"""

from __future__ import annotations

import hashlib

DOMAIN = b"bagel-pow1"
MAX_BITS = 40
NONCE_BYTES = 8


def _prefix(challenge: bytes, run_id: str, public_key: bytes) -> hashlib._Hash:
    h = hashlib.sha256(DOMAIN)
    h.update(len(challenge).to_bytes(2, "little"))
    h.update(challenge)
    rid = run_id.encode()
    h.update(len(rid).to_bytes(2, "little"))
    h.update(rid)
    h.update(public_key)
    return h


def leading_zero_bits(digest: bytes) -> int:
    """Number of leading zero bits of `digest`."""
    n = 0
    for byte in digest:
        if byte == 0:
            n += 8
            continue
        return n + 8 - byte.bit_length()
    return n


def pow_digest(challenge: bytes, run_id: str, public_key: bytes, nonce: int) -> bytes:
    h = _prefix(challenge, run_id, public_key)
    h.update(nonce.to_bytes(NONCE_BYTES, "little"))
    return h.digest()


def check_pow(challenge: bytes, run_id: str, public_key: bytes, nonce: int, bits: int) -> bool:
    """True if `nonce` is a solution with at least `bits` leading zero bits (one hash)."""
    if not 0 <= nonce < 1 << (8 * NONCE_BYTES):
        return False
    return leading_zero_bits(pow_digest(challenge, run_id, public_key, nonce)) >= bits


def solve_pow(
    challenge: bytes, run_id: str, public_key: bytes, bits: int, *, start: int = 0, max_tries: int = 1 << 40
) -> int:
    """The first nonce from `start` that solves the puzzle (about 2^bits tries).

    ValueError if `bits` is out of range or no solution was found in `max_tries`.
    """
    if not 0 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be in [0, {MAX_BITS}], got {bits}")
    base = _prefix(challenge, run_id, public_key)
    full, rest = divmod(bits, 8)
    mask = (0xFF << (8 - rest)) & 0xFF  # the high `rest` bits of the byte after the zero bytes
    for nonce in range(start, start + max_tries):
        h = base.copy()
        h.update(nonce.to_bytes(NONCE_BYTES, "little"))
        d = h.digest()
        if d[:full] == bytes(full) and (rest == 0 or d[full] & mask == 0):
            return nonce
    raise ValueError(f"no solution in {max_tries} tries")
