"""Device tokens (docs/protocol.md, "Device tokens"): Privacy Pass type 0x0002 (RFC 9578, blind
RSA-2048, RFC 9474 RSABSSA-SHA384-PSS-Deterministic), bound to one assignment and one envelope.

A task whose policy has a `device_auth` line counts only contributions carrying such a token. The
device draws its envelope's ephemeral X25519 key first, asks the issuer (whose trust-file entry
it must have) for a token whose nonce is SHA-256("confed token nonce v1" 0x00 enc), then seals
with that key. The issuer sees only a blinded message.
"""

from __future__ import annotations

import base64
import hashlib
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

TOKEN_TYPE = 0x0002
CONTEXT_LABEL = b"confed token context v1\x00"
NONCE_LABEL = b"confed token nonce v1\x00"
DEV_ATTESTATION_LABEL = b"confed-dev-attestation-v1\x00"
_SALT = 48
_HASH = 48


class TokenError(Exception):
    """A token could not be obtained or does not verify. ``status`` and ``problem`` (the
    issuer's problem+json) are set when the issuer refused."""

    def __init__(self, message: str, status: int | None = None, problem: dict | None = None):
        super().__init__(message)
        self.status = status
        self.problem = problem or {}


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64url(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def redemption_context(task_id: str, round_: int, assignment_ref: str) -> bytes:
    parts = [CONTEXT_LABEL, task_id.encode(), b"\x00", str(round_).encode(), b"\x00",
             assignment_ref.encode(), b"\x00"]
    return hashlib.sha256(b"".join(parts)).digest()


def challenge(issuer_name: str, task_id: str, round_: int, assignment_ref: str) -> bytes:
    """The encoded TokenChallenge of one assignment (origin_info empty)."""
    name = issuer_name.encode()
    return (TOKEN_TYPE.to_bytes(2, "big") + len(name).to_bytes(2, "big") + name + b"\x20"
            + redemption_context(task_id, round_, assignment_ref) + b"\x00\x00")


def token_nonce(enc: bytes) -> bytes:
    return hashlib.sha256(NONCE_LABEL + enc).digest()


def _der(data: bytes, tag: int) -> tuple[bytes, bytes]:
    if not data or data[0] != tag:
        raise TokenError("malformed token key")
    length, at = data[1], 2
    if length & 0x80:
        count = length & 0x7F
        length, at = int.from_bytes(data[2:2 + count], "big"), 2 + count
    return data[at:at + length], data[at + length:]


#: 1.2.840.113549.1.1.10, id-RSASSA-PSS, as DER OBJECT IDENTIFIER content.
_RSASSA_PSS = bytes([0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x01, 0x0A])


def issuer_public_key(spki: bytes) -> rsa.RSAPublicKey:
    """The RSA-2048 key inside an RSASSA-PSS SubjectPublicKeyInfo; `TokenError` otherwise."""
    outer, _ = _der(spki, 0x30)
    algorithm, rest = _der(outer, 0x30)
    oid, _ = _der(algorithm, 0x06)
    if oid != _RSASSA_PSS:
        raise TokenError("the token key is not an id-RSASSA-PSS key")
    bits, _ = _der(rest, 0x03)
    key, _ = _der(bits[1:], 0x30)
    n, rest = _der(key, 0x02)
    e, _ = _der(rest, 0x02)
    modulus = int.from_bytes(n, "big")
    if modulus.bit_length() != 2048:
        raise TokenError("the token key is not RSA-2048 (token type 0x0002)")
    return rsa.RSAPublicNumbers(int.from_bytes(e, "big"), modulus).public_key()


def _mgf1(seed: bytes, length: int) -> bytes:
    out = b""
    counter = 0
    while len(out) < length:
        out += hashlib.sha384(seed + counter.to_bytes(4, "big")).digest()
        counter += 1
    return out[:length]


def _emsa_pss_encode(message: bytes, em_bits: int) -> bytes:
    em_len = math.ceil(em_bits / 8)
    m_hash = hashlib.sha384(message).digest()
    salt = os.urandom(_SALT)
    h = hashlib.sha384(b"\x00" * 8 + m_hash + salt).digest()
    db = b"\x00" * (em_len - _SALT - _HASH - 2) + b"\x01" + salt
    masked = bytearray(a ^ b for a, b in zip(db, _mgf1(h, em_len - _HASH - 1)))
    masked[0] &= 0xFF >> (8 * em_len - em_bits)
    return bytes(masked) + h + b"\xbc"


@dataclass
class PendingToken:
    """A token input blinded for the issuer, and what unblinds its answer."""

    token_input: bytes
    blinded: bytes
    inverse: int


def begin(spki: bytes, challenge_bytes: bytes, nonce: bytes) -> PendingToken:
    """RFC 9474 `Blind` of the token input `0x0002 || nonce || SHA-256(challenge) || key id`."""
    key = issuer_public_key(spki).public_numbers()
    n, e = key.n, key.e
    token_input = (TOKEN_TYPE.to_bytes(2, "big") + nonce + hashlib.sha256(challenge_bytes).digest()
                   + hashlib.sha256(spki).digest())
    m = int.from_bytes(_emsa_pss_encode(token_input, n.bit_length() - 1), "big")
    if math.gcd(m, n) != 1:
        raise TokenError("the encoded message is not invertible modulo the key")
    while True:
        r = int.from_bytes(os.urandom(256), "big") % n
        if r > 1 and math.gcd(r, n) == 1:
            break
    blinded = (m * pow(r, e, n)) % n
    return PendingToken(token_input, blinded.to_bytes(256, "big"), pow(r, -1, n))


def finish(spki: bytes, pending: PendingToken, blind_signature: bytes) -> bytes:
    """RFC 9474 `Finalize`: the token (354 bytes), verified before it is returned."""
    public = issuer_public_key(spki)
    n = public.public_numbers().n
    signature = (int.from_bytes(blind_signature, "big") * pending.inverse % n).to_bytes(256, "big")
    try:
        public.verify(signature, pending.token_input,
                      padding.PSS(mgf=padding.MGF1(hashes.SHA384()), salt_length=_SALT),
                      hashes.SHA384())
    except Exception as error:  # noqa: BLE001 - cryptography's InvalidSignature
        raise TokenError("the issuer's answer does not unblind to a valid token") from error
    return pending.token_input + signature


@dataclass
class DevAttestation:
    """A P-256 key the device made itself: proves nothing about the device; only a dev issuer
    accepts it (tests, simulations, demos)."""

    key: ec.EllipticCurvePrivateKey = field(
        default_factory=lambda: ec.generate_private_key(ec.SECP256R1()))

    def evidence(self, challenge_bytes: bytes) -> dict:
        der = self.key.sign(DEV_ATTESTATION_LABEL + challenge_bytes, ec.ECDSA(hashes.SHA256()))
        r, s = decode_dss_signature(der)
        point = self.key.public_key().public_bytes(Encoding.X962, PublicFormat.CompressedPoint)
        return {"format": "dev", "public_key": b64url(point),
                "signature": b64url(r.to_bytes(32, "big") + s.to_bytes(32, "big"))}


@dataclass
class AndroidKeyAttestation:
    """Android key attestation: ``make_chain(challenge)`` is the platform code that generates a
    keystore key with the challenge as its attestation challenge and returns the key's
    certificate chain as DER bytes, the key's certificate first."""

    make_chain: Callable[[bytes], list[bytes]]

    def evidence(self, challenge_bytes: bytes) -> dict:
        return {"format": "android-key-attestation",
                "certificate_chain": [b64url(der) for der in self.make_chain(challenge_bytes)]}


APP_ATTEST_CLIENT_DATA_LABEL = b"confed-app-attest-v1\x00"


def app_attest_client_data_hash(challenge_bytes: bytes) -> bytes:
    """The ``clientDataHash`` an App Attest device passes to ``attestKey`` or
    ``generateAssertion`` for the issuer's challenge (docs/protocol.md, "Device tokens")."""
    return hashlib.sha256(APP_ATTEST_CLIENT_DATA_LABEL + challenge_bytes).digest()


class AppAttestServerUnavailable(Exception):
    """Raised by the platform's App Attest calls for ``DCError.serverUnavailable``: try again
    later with the same key."""


class AppAttestInvalidKey(Exception):
    """Raised by the platform's App Attest calls for ``DCError.invalidKey``: make a new key."""


#: The issuer's checks whose refusal means the App Attest key itself is unusable.
APP_ATTEST_KEY_CHECKS = frozenset({"key_id", "signature", "counter", "credential_id"})


@dataclass
class AppleAppAttest:
    """Apple App Attest: ``generate_key()``, ``attest_key(key_id, client_data_hash)`` and
    ``generate_assertion(key_id, client_data_hash)`` are the platform's ``DCAppAttestService``
    calls (raising ``AppAttestServerUnavailable`` or ``AppAttestInvalidKey`` where Apple says
    so). The first evidence attests a new key; later ones assert with it. Keep ``key_id`` across
    launches once ``state`` is "accepted" (pass both back). The key is dropped, and a new one
    attested, only when Apple or the issuer say the key is the problem (the Rust device's
    ``app_attest`` module does the same)."""

    generate_key: Callable[[], bytes]
    attest_key: Callable[[bytes, bytes], bytes]
    generate_assertion: Callable[[bytes, bytes], bytes]
    key_id: bytes | None = None
    #: "generated" (attestKey to retry), "sent" (awaiting the issuer), "accepted".
    state: str = "accepted"

    def evidence(self, challenge_bytes: bytes) -> dict:
        client_data_hash = app_attest_client_data_hash(challenge_bytes)
        if self.key_id is not None and self.state in ("sent", "accepted"):
            try:
                assertion = self.generate_assertion(self.key_id, client_data_hash)
            except AppAttestInvalidKey:
                self.key_id = None
                raise
            return {"format": "apple-app-attest", "key_id": b64url(self.key_id),
                    "assertion": b64url(assertion)}
        if self.key_id is None:
            self.key_id, self.state = self.generate_key(), "generated"
        try:
            obj = self.attest_key(self.key_id, client_data_hash)
        except AppAttestServerUnavailable:
            raise  # the same key next time, as Apple advises
        except Exception:
            self.key_id = None
            raise
        self.state = "sent"
        return {"format": "apple-app-attest", "key_id": b64url(self.key_id),
                "attestation": b64url(obj)}

    def accepted(self) -> None:
        if self.state == "sent":
            self.state = "accepted"

    def refused(self, failed_checks: list[str]) -> None:
        if APP_ATTEST_KEY_CHECKS.intersection(failed_checks):
            self.key_id = None


@dataclass
class TokenSource:
    """One issuer, as a device asks it for tokens: attests once per window, then presents the
    issuer's credential."""

    url: str
    attestation: DevAttestation | AndroidKeyAttestation | AppleAppAttest
    session: requests.Session = field(default_factory=requests.Session)
    _credential: tuple[str, int] | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _post(self, path: str, body: dict | None = None) -> dict:
        reply = self.session.post(self.url.rstrip("/") + path, json=body, timeout=30)
        if reply.status_code != 200:
            try:
                problem = reply.json()
            except ValueError:
                problem = {}
            problem = problem if isinstance(problem, dict) else {}
            detail = problem.get("detail", reply.text)
            raise TokenError(f"issuer {path}: {reply.status_code}: {detail}",
                             status=reply.status_code, problem=problem)
        return reply.json()

    _offered: list[bytes] | None = None

    def offered_keys(self, fresh: bool = False) -> list[bytes]:
        """The token keys (DER SPKI) the issuer's directory offers (`GET /v1/directory`), read
        once and again when `fresh`."""
        with self._lock:
            if self._offered is not None and not fresh:
                return self._offered
        reply = self.session.get(self.url.rstrip("/") + "/v1/directory", timeout=30)
        if reply.status_code != 200:
            raise TokenError(f"issuer /v1/directory: {reply.status_code}: {reply.text}")
        keys = [unb64url(k["token-key"]) for k in reply.json().get("token-keys", [])]
        with self._lock:
            self._offered = keys
        return keys

    def key_for(self, policy_keys: list[bytes]) -> bytes:
        """The first of a policy's token keys that the issuer offers (docs/protocol.md, "Device
        tokens": during a key rotation a policy may name a key the issuer does not hold yet, or no
        longer); the directory is read again once before giving up."""
        for fresh in (False, True):
            offered = self.offered_keys(fresh)
            for key in policy_keys:
                if key in offered:
                    return key
        raise TokenError(f"the issuer at {self.url} offers none of the {len(policy_keys)} token "
                         "keys the task's policy names (a key rotation in progress?)")

    def sign(self, spki: bytes, blinded: bytes) -> bytes:
        """The issuer's blind signature of one blinded message for the key `spki`."""
        truncated = hashlib.sha256(spki).digest()[31:]
        requests_ = [b64url(TOKEN_TYPE.to_bytes(2, "big") + truncated + blinded)]
        with self._lock:
            held = self._credential
        answer = None
        if held and time.time() < held[1]:
            try:
                answer = self._post("/v1/token-request",
                                    {"credential": held[0], "token_requests": requests_})
            except TokenError as error:
                if error.status != 403:
                    raise
        if answer is None:
            issued = unb64url(self._post("/v1/challenge")["challenge"])
            try:
                answer = self._post("/v1/token-request", {
                    "challenge": b64url(issued), "evidence": self.attestation.evidence(issued),
                    "token_requests": requests_})
            except TokenError as error:
                # 429: attested, out of tokens; 403 attestation-refused names the failed checks.
                if error.status == 429 and hasattr(self.attestation, "accepted"):
                    self.attestation.accepted()
                if (error.problem.get("type") == "urn:confed:problem:attestation-refused"
                        and hasattr(self.attestation, "refused")):
                    self.attestation.refused(
                        [c.get("check") for c in error.problem.get("failed_checks", [])])
                raise
            if hasattr(self.attestation, "accepted"):
                self.attestation.accepted()
        with self._lock:
            self._credential = (answer["credential"], answer["window_ends_at"])
        return unb64url(answer["token_responses"][0])


def obtain(source: TokenSource, issuer_name: str, spki: bytes, task_id: str, round_: int,
           assignment_ref: str, enc: bytes, nonce: bytes | None = None) -> bytes:
    """A token for one assignment, bound to the envelope whose encapsulated key is `enc`; in a
    masked task `nonce` is `masking.masked_nonce`, which binds the sealed seeds too."""
    pending = begin(spki, challenge(issuer_name, task_id, round_, assignment_ref),
                    token_nonce(enc) if nonce is None else nonce)
    return finish(spki, pending, source.sign(spki, pending.blinded))
