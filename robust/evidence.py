"""Signed contributions, signed receipts, and the adjudication of an accused reducer.

The mechanism (verified reducers). In a verified exchange each part j of the butterfly
all-reduce is reduced twice: by its primary (contributor j, which sends the result bytes
to every contributor) and by its shadow (contributor j+d mod k, which sends only the
digest; the offset d in [1, k-1] is drawn per exchange, `shadow_offset`), both with
`bagel.robust.reduction.reduce_one_part`, which is deterministic. Every
contribution travels in a `ContributionHeader` signed by its sender (Ed25519 over the
exchange tag, part, sha256 of the payload, weight, and the rest of the header), and every
reducer answers with a signed `EvidenceReceipt`: the result digest and every signed input
it used. A contributor applies part j only when sha256(primary bytes) equals the shadow's
digest; otherwise the round is not applied anywhere. The primary and the shadow each hold
all signed inputs of part j and the other's signed receipt, so whichever sees the other
disagree sends that as evidence (`EvidenceRequest`, the `Accuse` RPC); the coordinator
re-runs the reduction itself (`adjudicate`) and convicts only on proof:

- the accused's receipt digest differs from the rule applied to the signed inputs of the
  frozen contributor set: the reducer lied;
- a sender signed two different contributions to the same part (one in the accused's
  receipt, another among the accuser's inputs): the sender equivocated;
- anything else (a signature that does not verify, inputs of another exchange or of a
  non-contributor, incomplete inputs, a receipt that is the rule's result after all)
  convicts nobody and raises an `EvidenceError` naming what failed.

Cost: every contributor uploads each of its parts to two reducers, so the reduce-scatter
upload doubles, while the all-gather does not (the shadow answers with a receipt, no
bytes); in all the data plane moves 1.5x the butterfly's bytes (1.52x and 1.54x measured
for 3 and 4 members by bench/verified_reducers.py). Each part is reduced twice (twice the
reducer CPU). A receipt repeats the k signed headers of its inputs (~330 bytes each), and
each member receives 2k receipts: 2 k^2 x ~330 bytes per round (~10 KB at k = 4, ~170 KB
at k = 16), small next to a pseudo-gradient but quadratic in the group. Each contributor
signs k headers and verifies 2k receipts, each reducer verifies the k - 1 headers of each
part it reduces (~60 us per Ed25519 operation). The evidence holds the k inputs of one
part, k x enc(n / k) ~ enc(n): about one encoded delta (0.21 MB for 200k elements in int8,
checked in ~10 ms). It must fit the gRPC message limit (8 MiB), so a model whose encoded
delta is larger cannot be adjudicated yet: the accusation is refused as too large, and the
round still fails safely, unapplied.

What it does not catch: a primary that shows the shadow honest bytes but sends others
doctored ones is detected (the others' digests disagree, they do not apply the round)
but not convicted, because only the shadow could prove a lie and it saw none; the round
fails and the failure reports name the part and its reducers. Two colluding members can
agree on a wrong result when the draw makes one the shadow of the other's part: with the
offset drawn per exchange, that happens to a given pair with probability 2/(k-1) per
exchange (never for a lone attacker). More shadows per part would shrink it at more
upload each; BTARD (Gorbunov et al., "Secure Distributed Training at Scale", ICML 2022)
likewise relies on randomly chosen validators being honest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol import validation
from bagel.protocol.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, Identity, verify_signature, worker_id_of
from bagel.protocol.messages import FrozenMember
from bagel.robust.aggregation import Reducer
from bagel.robust.reduction import (
    Codec,
    NoValidContribution,
    PartInput,
    group_digest_of,
    header_problem,
    part_bounds,
    part_weights_of,
    reduce_one_part,
    result_generator,
    skipped_positions,
)

CONTRIBUTION_DOMAIN = b"bagel/contribution/v1\n"
RECEIPT_DOMAIN = b"bagel/receipt/v1\n"

# Bounds on an accusation, checked before anything is parsed or decoded (the same as the
# request validation's).
MAX_EVIDENCE_INPUTS = validation.MAX_EVIDENCE_INPUTS  # one per contributor of the part
MAX_HEADER_BYTES = validation.MAX_EVIDENCE_HEADER_BYTES  # one serialized ContributionHeader
MAX_RECEIPT_BYTES = validation.MAX_EVIDENCE_RECEIPT_BYTES


# ---------------------------------------------------------------- errors


class EvidenceError(Exception):
    """An accusation that convicts nobody; `status` is the gRPC status name to answer."""

    status = "INVALID_ARGUMENT"
    reason = "evidence_malformed"


class MalformedEvidence(EvidenceError):
    """Unparseable, oversized or internally inconsistent evidence."""


class ForgedEvidence(EvidenceError):
    """A signature in the evidence does not verify, or a key is not its signer's."""

    status = "UNAUTHENTICATED"
    reason = "evidence_forged"


class UnknownExchange(EvidenceError):
    """The exchange the evidence is about is not one the coordinator remembers freezing."""

    status = "NOT_FOUND"
    reason = "evidence_unknown_exchange"


class ForeignEvidence(EvidenceError):
    """Inputs or parties that are not of the frozen contributor set of that exchange."""

    status = "FAILED_PRECONDITION"
    reason = "evidence_foreign"


class IncompleteEvidence(EvidenceError):
    """The evidence lacks what a re-run of the reduction needs."""

    status = "FAILED_PRECONDITION"
    reason = "evidence_incomplete"


class EvidenceRefuted(EvidenceError):
    """The accused's signed result is the rule applied to the signed inputs: no lie."""

    status = "FAILED_PRECONDITION"
    reason = "evidence_refuted"


# ---------------------------------------------------------------- signing


def contribution_statement(h: dp.ContributionHeader) -> bytes:
    """The bytes a sender signs: the header without its signature, serialized deterministically."""
    c = dp.ContributionHeader()
    c.CopyFrom(h)
    c.ClearField("signature")
    return CONTRIBUTION_DOMAIN + c.SerializeToString(deterministic=True)


def sign_contribution(identity: Identity, h: dp.ContributionHeader) -> None:
    """Fill in the sender's key and signature (the header names `identity`'s worker id)."""
    h.sender_public_key = identity.public_key
    h.ClearField("signature")
    h.signature = identity.sign(contribution_statement(h))


def contribution_problem(h: dp.ContributionHeader) -> str:
    """Why a signed header is not its sender's ('' when the signature and key check out)."""
    if len(h.sender_public_key) != PUBLIC_KEY_BYTES or len(h.signature) != SIGNATURE_BYTES:
        return "unsigned contribution"
    if worker_id_of(h.sender_public_key) != h.sender:
        return f"the key is not {h.sender!r}'s"
    if h.payload_sha256 and len(h.payload_sha256) != 32:
        return "payload_sha256 is not 32 bytes"
    if not verify_signature(h.sender_public_key, h.signature, contribution_statement(h)):
        return "the contribution's signature does not verify"
    return ""


def sign_receipt(identity: Identity, receipt: dp.EvidenceReceipt) -> tuple[bytes, bytes]:
    """(the exact receipt bytes, the signature over them)."""
    blob = receipt.SerializeToString(deterministic=True)
    return blob, identity.sign(RECEIPT_DOMAIN + blob)


def open_receipt(blob: bytes, signature: bytes, public_key: bytes) -> dp.EvidenceReceipt:
    """The receipt, once its signature by `public_key` and its signer's id check out."""
    if len(blob) > MAX_RECEIPT_BYTES:
        raise MalformedEvidence(f"receipt of {len(blob)} bytes exceeds {MAX_RECEIPT_BYTES}")
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ForgedEvidence("the reducer's public key is not 32 bytes")
    r = dp.EvidenceReceipt()
    try:
        r.ParseFromString(blob)
    except DecodeError as e:
        raise MalformedEvidence(f"unparseable receipt: {e}") from None
    if worker_id_of(public_key) != r.reducer:
        raise ForgedEvidence(f"the key is not the reducer {r.reducer!r}'s")
    if not verify_signature(public_key, signature, RECEIPT_DOMAIN + blob):
        raise ForgedEvidence(f"the receipt signature of {r.reducer} does not verify")
    return r


def shadow_offset(tag: dp.ExchangeTag, k: int) -> int:
    """How far after its primary the shadow of every part sits in this exchange, in [1, k-1].

    Drawn from the exchange's coordinates, the coordinator-frozen group digest included, so
    nobody picks it: worker ids sort by a hash of the key, and a fixed "next in order" would
    let an attacker grind a second key that sorts right after its first and shadow itself.
    """
    if k < 2:
        return 0
    text = f"{tag.run_id}|{tag.cell_id}|{tag.round}|{tag.round_attempt}|{tag.reduce_attempt}|{tag.group_digest}"
    return 1 + int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % (k - 1)


def shadow_of(part: int, k: int, offset: int) -> int:
    """The position of the shadow reducer of `part` among k contributors (k >= 2)."""
    return (part + offset) % k


def _same_tag(a: dp.ExchangeTag, b: dp.ExchangeTag) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


# ---------------------------------------------------------------- adjudication


@dataclass(frozen=True)
class Conviction:
    """What the evidence proved: `worker_id` lied, and `reason` says how."""

    worker_id: str
    reason: str
    kind: str  # "reducer" (a wrong result) | "equivocation" (two signed contributions)


@dataclass(frozen=True)
class EvidenceParts:
    """An `EvidenceRequest` after its receipt's signature was checked."""

    receipt: dp.EvidenceReceipt
    inputs: tuple[tuple[dp.ContributionHeader, bytes], ...]


def parse_evidence(req: pb.EvidenceRequest) -> EvidenceParts:
    """Bounds, then the receipt's signature, then every input header parsed (not yet checked)."""
    if len(req.inputs) > MAX_EVIDENCE_INPUTS:
        raise MalformedEvidence(f"{len(req.inputs)} inputs, at most {MAX_EVIDENCE_INPUTS}")
    receipt = open_receipt(req.receipt, req.receipt_signature, req.reducer_public_key)
    inputs = []
    for n, e in enumerate(req.inputs):
        if len(e.contribution_header) > MAX_HEADER_BYTES:
            raise MalformedEvidence(f"inputs[{n}]: header of {len(e.contribution_header)} bytes")
        h = dp.ContributionHeader()
        try:
            h.ParseFromString(e.contribution_header)
        except DecodeError as exc:
            raise MalformedEvidence(f"inputs[{n}]: unparseable header: {exc}") from None
        inputs.append((h, bytes(e.payload)))
    return EvidenceParts(receipt, tuple(inputs))


def adjudicate(
    ev: EvidenceParts,
    *,
    run_id: str,
    accuser: str,
    members: Sequence[FrozenMember] | None,
    codec: Codec,
    reducer: Reducer,
) -> Conviction:
    """Re-run the disputed reduction; a `Conviction`, or an `EvidenceError` saying why none.

    members: the frozen contributor set (sorted by worker id) of the exchange the receipt
    names, from the coordinator's own memory (None: it does not know that exchange).
    CPU-bound (decodes and aggregates one part): call it off the event loop.
    """
    r = ev.receipt
    t = r.tag
    where = f"{t.cell_id} round {t.round} attempt {t.round_attempt}/{t.reduce_attempt} part {r.part}"
    if t.run_id != run_id:
        raise ForeignEvidence(f"the receipt is of run {t.run_id!r}")
    if members is None:
        raise UnknownExchange(f"no frozen contributor set known for {where}")
    if group_digest_of(members) != t.group_digest:
        raise ForeignEvidence(f"the receipt's contributor set is not the one frozen for {where}")
    ids = [m[0] for m in members]
    k = len(ids)
    if accuser not in ids:
        raise ForeignEvidence(f"the accuser {accuser} is not a contributor of {where}")
    if k < 2 or not 0 <= r.part < k:
        raise MalformedEvidence(f"part {r.part} of {k} contributors has no second reducer")
    shadow = ids[shadow_of(r.part, k, shadow_offset(t, k))]
    expected = {dp.EVIDENCE_ROLE_PRIMARY: ids[r.part], dp.EVIDENCE_ROLE_SHADOW: shadow}
    if expected.get(r.role) != r.reducer:
        raise ForeignEvidence(f"{r.reducer} is not the {dp.EvidenceRole.Name(r.role)} reducer of {where}")
    if len(r.result_sha256) != 32:
        raise MalformedEvidence("the receipt's result_sha256 is not 32 bytes")
    budget = {m[0]: m[2] for m in members}

    # every input: signed by its sender, of this exchange and part, one per contributor
    held: dict[str, tuple[dp.ContributionHeader, bytes]] = {}
    for h, payload in ev.inputs:
        problem = contribution_problem(h)
        if problem:
            raise ForgedEvidence(f"input from {h.sender!r}: {problem}")
        if not _same_tag(h.tag, t) or h.part != r.part:
            raise ForeignEvidence(f"input from {h.sender} is for another exchange or part")
        if h.sender not in budget:
            raise ForeignEvidence(f"input from {h.sender}, not a contributor of {where}")
        if h.sender in held:
            first = held[h.sender][0]
            if contribution_statement(first) != contribution_statement(h):
                return _equivocation(h.sender, where)
            raise MalformedEvidence(f"two copies of {h.sender}'s input")
        if payload and (hashlib.sha256(payload).digest() != h.payload_sha256 or len(payload) != h.payload_nbytes):
            raise MalformedEvidence(f"the payload of {h.sender}'s input does not match its signed digest")
        held[h.sender] = (h, payload)
    # a sender that signed another contribution for the accused than for the accuser
    for h in r.inputs:
        mine = held.get(h.sender)
        if (
            mine is not None
            and _same_tag(h.tag, t)
            and h.part == r.part
            and not contribution_problem(h)
            and contribution_statement(h) != contribution_statement(mine[0])
        ):
            return _equivocation(h.sender, where)
    missing = [x for x in ids if x not in held]
    if missing:
        raise IncompleteEvidence(f"no signed contribution of {missing} to {where}")
    if r.reducer_rule != reducer.spec():
        return Conviction(
            r.reducer,
            f"verified evidence: {r.reducer} signed {where} under rule {r.reducer_rule!r}, "
            f"the run's is {reducer.spec()!r}",
            "reducer",
        )
    if r.codec != codec.name:
        return Conviction(
            r.reducer,
            f"verified evidence: {r.reducer} signed {where} with codec {r.codec!r}, the run's is {codec.name!r}",
            "reducer",
        )
    own = held[accuser][0]
    if (own.total_numel, own.layout_digest) != (r.total_numel, r.layout_digest):
        raise IncompleteEvidence(f"the accuser and the accused disagree on the model layout of {where}")
    if not 0 < r.total_numel <= 1 << 40:
        raise MalformedEvidence(f"total_numel {r.total_numel}")
    # the split the members cut, with the frozen set's part weights (bound by the group digest)
    s, e = part_bounds(r.total_numel, k, skipped_positions(members), part_weights_of(members))[r.part]
    numel = e - s
    inputs = []
    for x in ids:
        h, payload = held[x]
        problem = header_problem(
            h, num_parts=k, total_numel=r.total_numel, part_numel=numel, layout_digest=r.layout_digest, codec=codec
        )
        if not problem and not payload:
            raise IncompleteEvidence(f"the payload of {x}'s input is missing")
        inputs.append(PartInput(x, float(h.weight), budget[x], payload or None, problem))
    gen = result_generator(t.run_id, t.cell_id, t.round, t.round_attempt, t.reduce_attempt, r.part)
    try:
        digest = reduce_one_part(codec, reducer, numel, inputs, gen).digest
    except NoValidContribution:
        return Conviction(
            r.reducer,
            f"verified evidence: {r.reducer} signed a result for {where}, which has no valid input",
            "reducer",
        )
    if digest == r.result_sha256:
        raise EvidenceRefuted(f"the {dp.EvidenceRole.Name(r.role)} reducer {r.reducer}'s result for {where} verifies")
    role = "primary" if r.role == dp.EVIDENCE_ROLE_PRIMARY else "shadow"
    return Conviction(
        r.reducer,
        f"verified evidence: {role} reducer of {where} signed result sha256 {r.result_sha256.hex()[:16]}, "
        f"the rule {reducer.spec()} over the {k} signed inputs gives {digest.hex()[:16]}",
        "reducer",
    )


def _equivocation(sender: str, where: str) -> Conviction:
    return Conviction(
        sender, f"verified evidence: {sender} signed two different contributions to {where}", "equivocation"
    )
