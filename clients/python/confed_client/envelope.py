"""The contribution envelope (docs/protocol.md, "Contribution envelope"): HPKE base mode,
DHKEM(X25519, HKDF-SHA256), HKDF-SHA256, AES-128-GCM, in a CBOR map."""

from __future__ import annotations

import hashlib
import os
import struct

import cbor2
from pyhpke import AEADId, CipherSuite, KDFId, KEMId

SUITE = CipherSuite.new(KEMId.DHKEM_X25519_HKDF_SHA256, KDFId.HKDF_SHA256, AEADId.AES128_GCM)
LABEL = b"confed contribution v2\x00"
ENVELOPE_VERSION = 2
#: The reference client seals updates above 1 MiB in chunks of 1 MiB.
CHUNK_ABOVE = 1 << 20
CHUNK = 1 << 20
TAG = 16


def _field(text: str) -> bytes:
    return text.encode("utf-8") + b"\x00"


def info(key_id: str) -> bytes:
    return LABEL + _field(key_id)


def assignment_ref(assignment_id: str) -> str:
    """Lowercase hex SHA-256 of the capability: how the enclave names an assignment."""
    return hashlib.sha256(assignment_id.encode("utf-8")).hexdigest()


def aad(task_id: str, round_: int, assignment_id: str, policy_sha256: str,
        model_sha256: str) -> bytes:
    return (LABEL + _field(task_id) + _field(str(round_)) + _field(assignment_ref(assignment_id))
            + _field(policy_sha256) + _field(model_sha256))


def _piece_aad(base: bytes, index: int, last: bool) -> bytes:
    return base + struct.pack(">I", index) + (b"\x01" if last else b"\x00")


def ephemeral():
    """An ephemeral key drawn before sealing (RFC 9180 DeriveKeyPair of 32 fresh bytes), so a
    device token can bind its encapsulated key (`ephemeral_enc`)."""
    return SUITE.kem.derive_key_pair(os.urandom(32))


def ephemeral_enc(key_pair) -> bytes:
    return key_pair.public_key.to_public_bytes()


def seal(public_key: bytes, info_bytes: bytes, aad_bytes: bytes, update: bytes,
         chunk: int | None = None, eks=None) -> tuple[bytes, bytes]:
    """(enc, ct). With `chunk`, one sender context seals `max(1, ceil(len / chunk))` pieces, the
    last holding the rest (an update of exactly k * chunk bytes is k full pieces). `eks`: an
    ephemeral key drawn ahead (`ephemeral`), else a fresh one."""
    enc, sender = SUITE.create_sender_context(
        SUITE.kem.deserialize_public_key(public_key), info=info_bytes, eks=eks)
    if chunk is None:
        return enc, sender.seal(update, aad=aad_bytes)
    count = max(1, -(-len(update) // chunk))
    pieces = [update[i * chunk:(i + 1) * chunk] for i in range(count)]
    return enc, b"".join(
        sender.seal(piece, aad=_piece_aad(aad_bytes, i, i == count - 1))
        for i, piece in enumerate(pieces))


def encode_envelope(key_id: str, enc: bytes, ct: bytes, chunk: int | None = None,
                    token: bytes | None = None, seeds: bytes | None = None) -> bytes:
    fields = {"v": ENVELOPE_VERSION, "key_id": key_id, "enc": enc, "ct": ct}
    if chunk is not None:
        fields["chunk"] = chunk
    if token is not None:
        fields["token"] = token
    if seeds is not None:
        fields["seeds"] = seeds
    return cbor2.dumps(fields)


def seal_update(public_key: bytes, key_id: str, aad_bytes: bytes, update: bytes, eks=None,
                token: bytes | None = None, seeds: bytes | None = None) -> bytes:
    """The envelope a device uploads: chunked when the update is over 1 MiB; with the device
    token obtained for `eks` when the task requires one; in a masked task with the mask seeds
    sealed to each key service (`masking.seal_seeds`, concatenated)."""
    chunk = CHUNK if len(update) > CHUNK_ABOVE else None
    enc, ct = seal(public_key, info(key_id), aad_bytes, update, chunk, eks)
    return encode_envelope(key_id, enc, ct, chunk, token, seeds)


def decode_envelope(data: bytes) -> dict:
    """The envelope's fields (for tests and tools); `ValueError` if it is not a v2 envelope."""
    fields = cbor2.loads(data)
    required = {"v", "key_id", "enc", "ct"}
    optional = {"chunk", "token", "seeds"}
    if not isinstance(fields, dict) or not required <= set(fields) <= required | optional:
        raise ValueError("not a contribution envelope")
    if fields["v"] != ENVELOPE_VERSION or len(fields["enc"]) != 32:
        raise ValueError("not a version 2 envelope")
    return fields


def open_envelope(fields: dict, private_key: bytes, info_bytes: bytes, aad_bytes: bytes) -> bytes:
    """The update (what the enclave does; for tests): cut a chunked `ct` into `chunk + 16`-byte
    pieces from the start, the last of them (shorter, or the k-th full one) flagged last."""
    recipient = SUITE.create_recipient_context(
        fields["enc"], SUITE.kem.deserialize_private_key(private_key), info=info_bytes)
    ct = fields["ct"]
    if "chunk" not in fields:
        return recipient.open(ct, aad=aad_bytes)
    step = fields["chunk"] + TAG
    starts = list(range(0, len(ct), step)) or [0]
    out = []
    for index, start in enumerate(starts):
        piece = ct[start:start + step]
        if len(piece) < TAG:
            raise ValueError("a chunked ciphertext's piece is shorter than its tag")
        out.append(recipient.open(piece, aad=_piece_aad(aad_bytes, index, index == len(starts) - 1)))
    return b"".join(out)
