"""Checking a release's proof of origin (docs/attestation.md, "Release commitments, the ledger
and receipts"), as `confed verify release` does: the manifest and average hash as they say, the
enclave's per-job key signed them, and enough trusted key services signed receipts for this
commitment, released to that enclave key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature


class ReleaseError(ValueError):
    """A release does not verify; `failures` lists every check that failed."""

    def __init__(self, failures: list[str]):
        super().__init__("; ".join(failures))
        self.failures = failures


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


_B64URL = re.compile(r"[A-Za-z0-9_-]*")


def _b64url(text: str) -> bytes:
    """Unpadded base64url, strictly (docs/attestation.md): padding or any other character is a
    ValueError, as in the Rust verifier."""
    if not isinstance(text, str) or not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("not unpadded base64url")
    decoded = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    # Non-canonical trailing bits (another text for the same bytes) are refused too.
    if base64.urlsafe_b64encode(decoded).rstrip(b"=").decode() != text:
        raise ValueError("not canonical base64url")
    return decoded


def _verify(key: ec.EllipticCurvePublicKey, text: str, signature: str) -> bool:
    try:
        raw = _b64url(signature)
        if len(raw) != 64:
            return False
        key.verify(encode_dss_signature(int.from_bytes(raw[:32], "big"),
                                        int.from_bytes(raw[32:], "big")),
                   text.encode("utf-8"), ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError):
        return False


def quorum(threshold: int, shares: int) -> int:
    """Receipts a release needs: max(t, ceil((n + t) / 2))."""
    return max(threshold, -(-(shares + threshold) // 2))


def commitment_text(commitment: dict) -> str:
    return "|".join(["confed-release-commitment-v1", commitment["task_id"],
                     str(commitment["round"]), commitment["key_id"],
                     commitment["policy_sha256"], commitment["model_sha256"],
                     commitment["inputs_digest"]])


def receipt_text(receipt: dict) -> str:
    return "|".join(["confed-release-receipt-v1"] + [str(receipt[k]) for k in (
        "keyservice_id", "key_id", "task_id", "round", "commitment_sha256",
        "enclave_signing_key", "image_digest", "policy", "threshold", "shares", "at")])


def verify_release(manifest_bytes: bytes, average_bytes: bytes, proof: dict,
                   keyservices: dict[str, ec.EllipticCurvePublicKey], threshold: int,
                   policy_text: str | None = None, shares: int | None = None) -> list[str]:
    """The checks that passed, one line each; `ReleaseError` listing those that failed.

    `keyservices`, `threshold` and `shares` (n; default: the key services given) are the
    partner's trust in the key services (a device trust file's, `Trust.keyservices`,
    `Trust.threshold` and `Trust.n`): the quorum of receipts is computed from them alone, and a
    receipt that states another threshold or number of shares is a failed check (t colluding key
    services whose share files say n = t would otherwise lower the quorum). `policy_text`, if
    given, is the task policy the partner created, which the manifest must name."""
    n = len(keyservices) if shares is None else shares
    if not 1 <= threshold <= n or n < len(keyservices):
        raise ValueError(f"threshold {threshold} of {n} shares with {len(keyservices)} key "
                         "services: the threshold must be between 1 and n, and n at least the "
                         "key services given")
    passed, failed = [], []

    def check(ok: bool, what: str) -> None:
        (passed if ok else failed).append(what)

    manifest = json.loads(manifest_bytes)
    commitment = {k: manifest[k] for k in (
        "task_id", "round", "key_id", "policy_sha256", "model_sha256", "inputs_digest")}
    digest = _sha256(commitment_text(commitment).encode("utf-8"))
    manifest_sha256, average_sha256 = _sha256(manifest_bytes), _sha256(average_bytes)
    check(manifest.get("average_sha256") == average_sha256,
          f"the average hashes to the manifest's average_sha256 ({average_sha256})")
    if policy_text is not None:
        check(manifest["policy_sha256"] == _sha256(policy_text.encode("utf-8")),
              "the manifest names the task's policy")
    check(proof.get("commitment") == commitment,
          f"the proof's commitment is the manifest's (digest {digest})")
    enclave = proof.get("enclave", {})
    enclave_key_text = enclave.get("enclave_signing_key", "")
    try:
        enclave_key = ec.EllipticCurvePublicKey.from_encoded_point(
            ec.SECP256R1(), _b64url(enclave_key_text))
        signed = _verify(enclave_key, "|".join([
            "confed-release-v1", commitment["task_id"], str(commitment["round"]), digest,
            manifest_sha256, average_sha256]), enclave.get("signature", ""))
    except ValueError:
        signed = False
    check(signed, "the enclave's per-job key signed this manifest and average")
    vouching: dict[str, dict] = {}
    for receipt in proof.get("receipts", []):
        service = receipt.get("keyservice_id")
        key = keyservices.get(service)
        if key is None or service in vouching:
            continue  # not trusted, or a second receipt of one key service
        if (_verify(key, receipt_text(receipt), receipt.get("signature", ""))
                and receipt["commitment_sha256"] == digest
                and (receipt["task_id"], receipt["round"]) == (commitment["task_id"],
                                                               commitment["round"])
                and receipt["enclave_signing_key"] == enclave_key_text
                and receipt["key_id"] == commitment["key_id"]):
            if (receipt["threshold"], receipt["shares"]) != (threshold, n):
                check(False, f"receipt of key service {service} states threshold "
                             f"{receipt['threshold']} of {receipt['shares']} shares; the trust "
                             f"file pins {threshold} of {n}")
                continue
            vouching[service] = receipt
    needed = quorum(threshold, n)
    check(len(vouching) >= max(1, needed),
          f"{len(vouching)} of the {needed} receipts needed from trusted key services "
          f"(threshold {threshold} of {n} shares, from the trust file)")
    if failed:
        raise ReleaseError(failed)
    guarantee = guarantee_line(manifest)
    health = health_line(manifest)
    return ([guarantee] if guarantee else []) + passed + ([health] if health else [])


def health_line(manifest: dict) -> str | None:
    """The round's noised health count (docs/privacy.md, "Health"), as `confed verify release`
    prints it; None for tasks without the health signal. The count is unbiased noise added to
    the true number, so it may lie below 0 or above `included`."""
    health = manifest.get("health")
    if not health:
        return None
    return (f"health: {health['zeroed']} of {manifest['included']} included devices sent zeros "
            "in place of a trained update, noised (standard deviation "
            f"{health['stddev']:.2f} devices; the count may fall outside "
            f"0..={manifest['included']})")


def guarantee_line(manifest: dict) -> str | None:
    """What the accounting guarantees on one device's contribution to a DP-FTRL round (tree or
    BLT), before what the release alone carries: a DP-FTRL release's own noise is not its
    guarantee (docs/privacy.md, "Reading a DP-FTRL manifest", "Reading a BLT manifest"). None
    for independent noise and for releases of servers that did not record it."""
    noise = manifest.get("noise", {})
    tree, blt = noise.get("tree"), noise.get("blt")
    if tree and "accounted_stddev_sum" in tree and "accounted_depth" in tree:
        return (f"noise: the accounting guarantees {tree['accounted_stddev_sum']:.6f} per "
                "coordinate of the sum on one device's contribution, even to whoever knows "
                f"every other round of tree {tree['tree']} ({tree['accounted_depth']} complete "
                f"nodes over a round); this release alone carries {noise['stddev_sum']:.6f}")
    if blt and "accounted_stddev_sum" in blt and "accounted_sensitivity" in blt:
        return (f"noise: the accounting guarantees {blt['accounted_stddev_sum']:.6f} per "
                "coordinate of the sum on one device's contribution, even to whoever knows "
                "every other contribution and every release of the task's "
                f"{manifest['privacy']['rounds_planned']} planned rounds (sensitivity "
                f"{blt['accounted_sensitivity']:.4f} clip norms); this release alone carries "
                f"{noise['stddev_sum']:.6f}")
    return None
