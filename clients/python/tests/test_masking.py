"""Masked tasks on the Python device: byte for byte what the Rust library computes
(tests/vectors/masking.json), and the policy line's keys accepted only when the trust file's
key services signed them."""

import base64
import json
import pathlib

import numpy as np
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from confed_client import envelope, masking, policy

VECTORS = pathlib.Path(__file__).resolve().parents[3] / "tests" / "vectors" / "masking.json"
CASES = json.loads(VECTORS.read_text())


@pytest.mark.parametrize("case", CASES,
                         ids=lambda c: f"{c['threshold']}-of-{c['services']}-ring{c['ring']}")
def test_grid_masks_aad_and_nonce_are_byte_for_byte_the_rust_librarys(case):
    n, t = case["services"], case["threshold"]
    assert [list(g) for g in masking.groups(n, t)] == case["groups"]
    grid = masking.clip_to_grid(np.array(case["update"], np.float32), case["clip_norm"])
    assert grid.tolist() == case["grid"]
    ctx = masking.context(case["task_id"], case["round"], case["assignment_ref"],
                          case["policy_sha256"], grid.size)
    seeds = [bytes.fromhex(s) for s in case["seeds_hex"]]
    masked = masking.mask(grid, seeds, ctx, case["ring"])
    assert masking.encode_masked(masked, case["ring"]).hex() == case["masked_update_hex"]
    assert [masking.seeds_aad(ctx, j).hex() for j in range(1, n + 1)] == case["seeds_aad_hex"]
    lengths = [masking.sealed_len(n, t, j) for j in range(1, n + 1)]
    assert lengths == case["sealed_lengths"]
    items = [bytes([j]) * lengths[j - 1] for j in range(1, n + 1)]
    enc = bytes.fromhex(case["enc_hex"])
    assert masking.masked_nonce(enc, items).hex() == case["nonce_hex"]


def test_sealed_seeds_open_for_their_service_only_and_are_the_layouts_length():
    n, t = 5, 3
    keys = [envelope.SUITE.kem.derive_key_pair(bytes([i]) * 32) for i in range(n)]
    public = [k.public_key.to_public_bytes() for k in keys]
    ctx = masking.context("task-v", 7, "ab" * 32, "cd" * 32, 4)
    seeds = masking.draw_seeds(n, t)
    sealed = masking.seal_seeds(n, t, seeds, public, ctx)
    for j, item in enumerate(sealed, start=1):
        assert len(item) == masking.sealed_len(n, t, j)
        recipient = envelope.SUITE.create_recipient_context(
            item[:32], keys[j - 1].private_key, info=b"confed mask seeds v1")
        opened = recipient.open(item[32:], aad=masking.seeds_aad(ctx, j))
        mine = [s for s, g in zip(seeds, masking.groups(n, t)) if j in g]
        assert opened == b"".join(mine)


def _signed_line(signers, t=2):
    entries = []
    for i, signer in enumerate(signers, start=1):
        key = envelope.SUITE.kem.derive_key_pair(bytes([i + 40]) * 32)
        public = base64.urlsafe_b64encode(key.public_key.to_public_bytes()).rstrip(b"=").decode()
        der = signer.sign(f"confed-masking-key-v1|ks{i}|{public}".encode(),
                          ec.ECDSA(hashes.SHA256()))
        r, s = decode_dss_signature(der)
        s = min(s, masking._HALF_ORDER * 2 + 1 - s)  # low s, as the key services sign
        sig = base64.urlsafe_b64encode(r.to_bytes(32, "big") + s.to_bytes(32, "big"))
        point = signer.public_key().public_bytes(serialization.Encoding.X962,
                                                 serialization.PublicFormat.UncompressedPoint)
        verifying = base64.urlsafe_b64encode(point).rstrip(b"=").decode()
        entries.append(f"ks{i}:{verifying}:{public}:{sig.rstrip(b'=').decode()}")
    return f"confed-masking/v1;threshold={t};services={','.join(entries)}"


def test_a_device_accepts_masking_keys_only_as_its_trusted_services_signed_them():
    signers = [ec.generate_private_key(ec.SECP256R1()) for _ in range(3)]
    trusted = {f"ks{i}": s.public_key() for i, s in enumerate(signers, start=1)}
    line = masking.parse_line(_signed_line(signers))
    keys = masking.accept(line, 2, 3, trusted)
    assert len(keys) == 3 and all(len(k) == 32 for k in keys)
    forged = dict(line, services=[dict(s) for s in line["services"]])
    forged["services"][1]["public_key"] = forged["services"][0]["public_key"]
    with pytest.raises(masking.MaskingError, match="not signed by it"):
        masking.accept(forged, 2, 3, trusted)
    impostor = ec.generate_private_key(ec.SECP256R1())
    posing = masking.parse_line(_signed_line([signers[0], impostor, signers[2]]))
    with pytest.raises(masking.MaskingError, match="another verifying key"):
        masking.accept(posing, 2, 3, trusted)
    with pytest.raises(masking.MaskingError, match="does not list"):
        masking.accept(line, 2, 3, {"ks1": trusted["ks1"], "ks2": trusted["ks2"]})
    with pytest.raises(masking.MaskingError, match="pins 3 of 3"):
        masking.accept(line, 3, 3, trusted)


def test_the_policy_parses_a_masking_line_between_device_auth_and_analytics():
    signers = [ec.generate_private_key(ec.SECP256R1()) for _ in range(3)]
    text = ("confed-task-policy/v3\ntask_id=t\ntenant_id=x\npopulation=p\nrounds=1\n"
            "report_goal=1\nmin_reports=1\nepsilon=4e0\ndelta=1e-6\nclip_norm=1e0\n"
            "mechanism=discrete_gaussian_on_grid\nserver_learning_rate=1e0\nplan={}\n"
            "upload_window=0,0\ndevice_auth=privacy_pass;issuer=i;token_keys=AAAA\n"
            f"masking={_signed_line(signers)}\n")
    parsed = policy.parse_policy(text)
    assert parsed["masking"]["threshold"] == 2
    assert parsed["device_auth"]["issuer"] == "i"
    plain = text[:text.index("masking=")]
    assert policy.parse_policy(plain)["masking"] is None
    # Distributed noise rides on per-round Gaussian noise only.
    noised = text.replace("threshold=2;", "threshold=2;noise=4294967296;")
    assert policy.parse_policy(noised)["masking"]["noise_variance"] == 4294967296
    with pytest.raises(policy.PolicyError, match="per-round"):
        policy.parse_policy(noised.replace(
            "mechanism=discrete_gaussian_on_grid",
            "mechanism=tree_aggregation_on_grid;min_separation=2"))
    with pytest.raises(policy.PolicyError):
        policy.parse_policy(plain.replace("device_auth", "masking"))


def test_a_masking_signature_with_a_high_s_is_refused_so_one_policy_has_one_text():
    signers = [ec.generate_private_key(ec.SECP256R1()) for _ in range(3)]
    line = _signed_line(signers)
    masking.parse_line(line)
    service = line.split("services=")[1].split(",")[0]
    signature = masking._b64url(service.split(":")[3])
    order = masking._HALF_ORDER * 2 + 1
    high = signature[:32] + (order - int.from_bytes(signature[32:], "big")).to_bytes(32, "big")
    flipped = base64.urlsafe_b64encode(high).rstrip(b"=").decode()
    with pytest.raises(masking.MaskingError, match="low"):
        masking.parse_line(line.replace(service.split(":")[3], flipped, 1))



def test_a_masking_line_with_distributed_noise_parses_in_its_one_canonical_form():
    signers = [ec.generate_private_key(ec.SECP256R1()) for _ in range(3)]
    plain = _signed_line(signers)
    noised = plain.replace("threshold=2;", "threshold=2;noise=4294967296;")
    assert masking.parse_line(plain)["noise_variance"] is None
    parsed = masking.parse_line(noised)
    assert parsed["noise_variance"] == 4294967296 and parsed["threshold"] == 2
    assert parsed["ring"] == 64
    ringed = masking.parse_line(noised.replace("threshold=2;", "threshold=2;ring=32;"))
    assert ringed["ring"] == 32 and ringed["noise_variance"] == 4294967296
    for bad in ["ring=64;", "ring=032;"]:
        with pytest.raises(masking.MaskingError):
            masking.parse_line(noised.replace("threshold=2;", f"threshold=2;{bad}"))
    for bad in ["noise=04294967296", "noise=0", "noise=-1", f"noise={(1 << 60) + 1}"]:
        with pytest.raises(masking.MaskingError):
            masking.parse_line(noised.replace("noise=4294967296", bad))
