"""Masked tasks on the device (docs/secure-aggregation.md, docs/protocol.md "Masks"): the
policy's `masking` line and its signed keys, the device's clipping on the grid, the mask streams,
the seeds sealed to each key service and the v2 token nonce that binds them. Byte for byte what
the Rust library computes (tests/vectors/masking.json)."""

from __future__ import annotations

import base64
import hashlib
import itertools
import math
import os
import re

import numpy as np
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

SCHEME = "confed-masking/v1"
MAX_SERVICES = 7
MAX_NOISE_VARIANCE = 1 << 60  # distributed noise: the exact sampler's range
SEED_BYTES = 32
GRID_UNITS_PER_CLIP = 1 << 16
MASKED_TENSOR = "confed.masked"
KEY_LABEL = "confed-masking-key-v1"
_STREAM_LABEL = b"confed mask stream v1"
_SEEDS_INFO = b"confed mask seeds v1"
_NONCE_LABEL = b"confed token nonce v2\x00"
_MAX_PASSES = 4
_ID = re.compile(r"[A-Za-z0-9._-]{1,64}\Z")
#: Half the P-256 group order: a masking key's signature must have s at most this.
_HALF_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551 // 2


class MaskingError(ValueError):
    pass


def _b64url(text: str) -> bytes:
    raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    if base64.urlsafe_b64encode(raw).rstrip(b"=").decode() != text:
        raise MaskingError("not canonical base64url without padding")
    return raw


def quorum(n: int, t: int) -> int:
    """The release quorum q = max(t, ceil((n + t) / 2))."""
    return max(t, -(-(n + t) // 2))


def groups(n: int, t: int) -> list[tuple[int, ...]]:
    """Every subset of n - q + 1 of the key services 1..n, members ascending, in lexicographic
    order: group g's seed is sealed to each of its members."""
    if not 1 <= t <= n <= MAX_SERVICES:
        raise MaskingError(f"a masked layout needs 1 <= t <= n <= {MAX_SERVICES}")
    return list(itertools.combinations(range(1, n + 1), n - quorum(n, t) + 1))


def parse_line(value: str) -> dict:
    """The value of a policy's `masking=` line: {"threshold", "ring" (32 or 64: the masks'
    modulus' bits), "noise_variance" (distributed
    noise's per-group variance in grid units squared, or None), "services": [{"id",
    "verifying_key", "public_key", "signature"}]} (keys as the base64url text), checked as the
    enclave checks it."""
    malformed = MaskingError(f"`masking` must be `{SCHEME};threshold=<t>[;ring=32][;noise=<v>];"
                             "services=<id>:<verifying_key>:<key>:<signature>,...`")
    head = f"{SCHEME};threshold="
    if not value.startswith(head) or ";services=" not in value:
        raise malformed
    threshold_text, services_text = value[len(head):].split(";services=", 1)
    noise_variance = None
    if ";noise=" in threshold_text:
        threshold_text, noise_text = threshold_text.split(";noise=", 1)
        if not re.fullmatch(r"[1-9][0-9]*", noise_text) or int(noise_text) > MAX_NOISE_VARIANCE:
            raise malformed
        noise_variance = int(noise_text)
    ring = 64
    if ";ring=" in threshold_text:
        threshold_text, ring_text = threshold_text.split(";ring=", 1)
        if ring_text != "32":
            raise malformed
        ring = 32
    if not re.fullmatch(r"[1-9][0-9]*", threshold_text):
        raise malformed
    services = []
    for entry in services_text.split(","):
        parts = entry.split(":")
        if len(parts) != 4:
            raise malformed
        services.append({"id": parts[0], "verifying_key": parts[1], "public_key": parts[2],
                         "signature": parts[3]})
    threshold = int(threshold_text)
    groups(len(services), threshold)  # the layout's bounds
    ids = [s["id"] for s in services]
    if any(not _ID.match(i) for i in ids) or len(set(ids)) != len(ids):
        raise MaskingError("masking: key service ids must be distinct, 1-64 of A-Z a-z 0-9 . _ -")
    keys = []
    for service in services:
        signature = _b64url(service["signature"])
        if len(signature) == 64 and int.from_bytes(signature[32:], "big") > _HALF_ORDER:
            raise MaskingError(f"masking: key service {service['id']}: the signature's s is "
                               "not low (one key has one signature text)")
        if (len(_b64url(service["verifying_key"])) != 65
                or len(_b64url(service["public_key"])) != 32
                or len(_b64url(service["signature"])) != 64):
            raise MaskingError(f"masking: key service {service['id']}: a 65-byte verifying key, "
                               "a 32-byte key and a 64-byte signature, base64url")
        keys.append(service["public_key"])
    if len(set(keys)) != len(keys):
        raise MaskingError("masking: two key services have the same masking key")
    return {"threshold": threshold, "ring": ring, "noise_variance": noise_variance,
            "services": services}


def accept(masking: dict, threshold: int, shares: int,
           keyservices: dict[str, ec.EllipticCurvePublicKey]) -> list[bytes]:
    """The masking keys to seal seeds to, service 1 first, if the line names exactly the
    trust file's threshold and n, every service listed in it under the verifying key listed
    there, each key signed by its service over `confed-masking-key-v1|<id>|<public_key>`.
    `MaskingError` saying why otherwise."""
    services = masking["services"]
    if masking["threshold"] != threshold or len(services) != shares:
        raise MaskingError(f"the task masks with {masking['threshold']} of {len(services)} key "
                           f"services; this device's trust file pins {threshold} of {shares}")
    keys = []
    for service in services:
        verifying = keyservices.get(service["id"])
        if verifying is None:
            raise MaskingError(f"the task seals mask seeds to key service {service['id']}, "
                               "which this device's trust file does not list")
        named = _b64url(service["verifying_key"])
        listed = verifying.public_bytes(serialization.Encoding.X962,
                                        serialization.PublicFormat.UncompressedPoint)
        if named != listed:
            raise MaskingError(f"the task's masking key for key service {service['id']} is "
                               "not signed by it (another verifying key)")
        raw = _b64url(service["signature"])
        der = encode_dss_signature(int.from_bytes(raw[:32], "big"),
                                   int.from_bytes(raw[32:], "big"))
        message = f"{KEY_LABEL}|{service['id']}|{service['public_key']}".encode()
        try:
            verifying.verify(der, message, ec.ECDSA(hashes.SHA256()))
        except InvalidSignature as error:
            raise MaskingError(f"the task's masking key for key service {service['id']} is "
                               "not signed by it") from error
        keys.append(_b64url(service["public_key"]))
    return keys


def clip_to_grid(values: np.ndarray, clip_norm: float) -> np.ndarray:
    """The update (F32 values) clipped to `clip_norm` on the grid: scaled so the clip norm is
    2^16 units, rounded half to even, shrunk by the rounding's worst case until the exact
    integer L2 norm is at most 2^16; zeros for a NaN or infinity (Rust `grid::clip_to_grid`).
    Every pass runs whatever the values (the first that fits is kept): the device clips at its
    send instant, and when it sends must not depend on its update."""
    flat = np.asarray(values, dtype=np.float32).astype(np.float64).ravel()
    # Summed one value after another, as the Rust library does: the same float, so the same
    # decision whether to shrink.
    squares = 0.0
    for v in flat.tolist():
        squares += v * v
    norm = math.sqrt(squares)
    clip_ok = 1e-6 <= clip_norm <= 1e6
    usable = math.isfinite(norm) and clip_ok
    clip = clip_norm if clip_ok else 1.0
    # A non-finite update is passed over like any other (as zeros), then zeros are sent; both
    # buffers are made either way.
    zeros = np.zeros(flat.size)
    zero_grid = np.zeros(flat.size, dtype=np.int64)
    work = flat if usable else zeros
    factor = clip / norm if usable and norm > clip else 1.0
    margin = (math.sqrt(flat.size) / 2.0 + 1.0) / GRID_UNITS_PER_CLIP
    chosen = None
    for _ in range(_MAX_PASSES):
        units = GRID_UNITS_PER_CLIP * (factor / clip)
        grid = np.rint(work * units).astype(np.int64)
        # Exact in int64: every value is within 2^16 (the factor clips the norm first), so the
        # sum of squares stays below 2^63 for any model under 2^31 values.
        fits = int(np.dot(grid, grid)) <= GRID_UNITS_PER_CLIP ** 2
        if chosen is None and fits:
            chosen = grid
        factor *= max(1.0 - margin, 0.5)
    return chosen if chosen is not None and usable else zero_grid


def context(task_id: str, round_: int, assignment_ref: str, policy_sha256: str,
            values: int) -> bytes:
    """What one input's masks are bound to, the policy's hash among it: seeds sealed under one
    policy open under no other."""
    parts = [_STREAM_LABEL, task_id.encode(), str(round_).encode(), assignment_ref.encode(),
             policy_sha256.encode(), str(values).encode()]
    return b"".join(p + b"\x00" for p in parts)


def _dtype(ring: int) -> str:
    if ring not in (32, 64):
        raise MaskingError(f"a masking ring is 2^32 or 2^64, not 2^{ring}")
    return "<u4" if ring == 32 else "<u8"


def stream(seed: bytes, context_bytes: bytes, group: int, values: int,
           ring: int = 64) -> np.ndarray:
    """Group `group`'s stream: AES-128-CTR from a zero counter over zeros, under the key that
    AES-256 (the seed as its key) makes of the first 16 bytes of SHA-256(context || group),
    read as little-endian words of the ring's width (`ring` 32 or 64 bits)."""
    dtype = _dtype(ring)
    block = hashlib.sha256(context_bytes + str(group).encode() + b"\x00").digest()[:16]
    encryptor = Cipher(algorithms.AES(seed), modes.ECB()).encryptor()
    key = encryptor.update(block) + encryptor.finalize()
    ctr = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    keystream = ctr.update(bytes(ring // 8 * values)) + ctr.finalize()
    return np.frombuffer(keystream, dtype=dtype)


def mask(grid: np.ndarray, seeds: list[bytes], context_bytes: bytes,
         ring: int = 64) -> np.ndarray:
    """The grid values plus every group's stream, mod 2^ring (the policy line's `ring`)."""
    dtype = _dtype(ring)
    masked = np.asarray(grid, dtype=np.int64).astype(np.uint64).astype(dtype)  # mod 2^ring
    for group, seed in enumerate(seeds):
        masked = masked + stream(seed, context_bytes, group, masked.size, ring)  # wraps
    return masked


def seeds_aad(context_bytes: bytes, service: int) -> bytes:
    return context_bytes + str(service).encode() + b"\x00"


def sealed_len(n: int, t: int, service: int) -> int:
    return 32 + SEED_BYTES * sum(service in g for g in groups(n, t)) + 16


def seal_seeds(n: int, t: int, seeds: list[bytes], service_keys: list[bytes],
               context_bytes: bytes) -> list[bytes]:
    """Each key service's sealed seeds (`enc || ct`), service 1 first: HPKE to its masking key
    of the seeds of its groups, in group order."""
    from .envelope import SUITE

    layout = groups(n, t)
    if len(seeds) != len(layout) or len(service_keys) != n:
        raise MaskingError("one seed per group and one key per key service")
    sealed = []
    for service in range(1, n + 1):
        plaintext = b"".join(seed for seed, g in zip(seeds, layout) if service in g)
        enc, sender = SUITE.create_sender_context(
            SUITE.kem.deserialize_public_key(service_keys[service - 1]), info=_SEEDS_INFO)
        sealed.append(enc + sender.seal(plaintext, aad=seeds_aad(context_bytes, service)))
    return sealed


def draw_seeds(n: int, t: int) -> list[bytes]:
    return [os.urandom(SEED_BYTES) for _ in groups(n, t)]


def masked_nonce(enc: bytes, sealed: list[bytes]) -> bytes:
    """The token nonce of a masked contribution: SHA-256("confed token nonce v2" 0x00 enc ||
    SHA-256(sealed_1) || ... || SHA-256(sealed_n))."""
    digest = hashlib.sha256(_NONCE_LABEL + enc)
    for item in sealed:
        digest.update(hashlib.sha256(item).digest())
    return digest.digest()


def flatten(update: dict) -> np.ndarray:
    """The update's values in the masked vector's order: tensors by ascending name (byte
    order), each row-major."""
    names = sorted(update, key=lambda name: name.encode())
    if not names:
        return np.zeros(0, dtype=np.float32)
    return np.concatenate([np.asarray(update[n], dtype=np.float32).ravel() for n in names])


def encode_masked(masked: np.ndarray, ring: int = 64) -> bytes:
    """The masked update as the device seals it: safetensors with the one tensor, U64 (U32 in
    the ring of 2^32)."""
    from safetensors.numpy import save

    return save({MASKED_TENSOR: np.ascontiguousarray(masked, dtype=_dtype(ring))})
