"""The worked example of docs/protocol.md, reproduced with this package: every documented byte."""

from __future__ import annotations

import os
import re

import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from confed_client import envelope
from confed_client.policy import PolicyError, check_policy, parse_policy, policy_sha256, rust_e
from confed_client.tensors import from_safetensors

from conftest import PROTOCOL_MD


def block(tag: str) -> str:
    text = PROTOCOL_MD.read_text(encoding="utf-8")
    found = re.search(r"^```text " + re.escape(tag) + r"\n(.*?)^```", text, re.S | re.M)
    assert found, f"docs/protocol.md has no block {tag}"
    return found.group(1)


@pytest.fixture(scope="module")
def example():
    values = dict(line.split(None, 1) for line in block("worked-example").splitlines()
                  if line.strip())
    return {key: value.strip() for key, value in values.items()}


@pytest.fixture(scope="module")
def policy_text():
    return block("worked-example-policy").encode("utf-8")


def test_the_policy_parses_and_hashes_as_documented(example, policy_text):
    policy = parse_policy(policy_text)
    assert policy["epsilon"] == 4.0 and policy["delta"] == 1e-6
    assert policy_sha256(policy_text) == example["policy_sha256"]
    check_policy(policy, task_id=example["task_id"], population=policy["population"],
                 round_=int(example["round"]),
                 limits={"max_epsilon": 10.0, "max_delta": 1e-5, "min_reports": 10})
    assert [rust_e(x) for x in (4.0, 1e-6, 0.05, 15.0)] == ["4e0", "1e-6", "5e-2", "1.5e1"]


@pytest.mark.parametrize("change", [
    (b"epsilon=4e0", b"epsilon=4.0"), (b"epsilon=4e0", b"epsilon=40e-1"),
    (b"epsilon=4e0", b"epsilon=4E0"), (b"rounds=5", b"rounds=05"), (b"\n", b"\r\n"),
])
def test_a_non_canonical_policy_is_refused(policy_text, change):
    with pytest.raises(PolicyError):
        parse_policy(policy_text.replace(*change))


def test_a_policy_beyond_the_devices_limits_is_refused(example, policy_text):
    policy = parse_policy(policy_text)
    with pytest.raises(PolicyError, match="epsilon"):
        check_policy(policy, task_id=example["task_id"], population=policy["population"],
                     round_=1, limits={"max_epsilon": 1.0, "max_delta": 1e-5, "min_reports": 1})


def test_info_aad_and_the_envelope_are_the_documented_bytes(example, policy_text):
    h = bytes.fromhex
    model = h(example["model"])
    model_sha256 = __import__("hashlib").sha256(model).hexdigest()
    assert model_sha256 == example["model_sha256"]
    assert envelope.assignment_ref(example["assignment_id"]) == example["assignment_ref"]
    assert envelope.info(example["key_id"]) == h(example["info"])
    aad = envelope.aad(example["task_id"], int(example["round"]), example["assignment_id"],
                       policy_sha256(policy_text), model_sha256)
    assert aad == h(example["aad"])
    private = h(example["recipient_private_key"])
    public = X25519PrivateKey.from_private_bytes(private).public_key().public_bytes_raw()
    assert public == h(example["recipient_public_key"])
    documented = h(example["envelope"])
    fields = envelope.decode_envelope(documented)
    assert envelope.encode_envelope(fields["key_id"], fields["enc"], fields["ct"]) == documented
    update = envelope.open_envelope(fields, private, envelope.info(example["key_id"]), aad)
    assert update == h(example["update"])
    assert from_safetensors(update)["dense.bias"].tolist() == [0.5, -0.25]


@pytest.mark.parametrize("size", [0, 1000, 1024, 2048, 3000])
def test_chunked_sealing_round_trips_and_an_exact_multiple_has_no_empty_piece(size):
    private = X25519PrivateKey.generate()
    public = private.public_key().public_bytes_raw()
    update = os.urandom(size)
    enc, ct = envelope.seal(public, b"info", b"aad", update, chunk=1024)
    pieces = max(1, -(-size // 1024))
    assert len(ct) == size + 16 * pieces
    fields = {"v": 2, "key_id": "k", "enc": enc, "ct": ct, "chunk": 1024}
    opened = envelope.open_envelope(fields, private.private_bytes_raw(), b"info", b"aad")
    assert opened == update
    if pieces > 1:
        truncated = dict(fields, ct=ct[:(pieces - 1) * (1024 + 16)])
        with pytest.raises(Exception):
            envelope.open_envelope(truncated, private.private_bytes_raw(), b"info", b"aad")
