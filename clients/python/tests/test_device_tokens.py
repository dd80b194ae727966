"""Device tokens from Python (docs/protocol.md, "Device tokens"): Python devices obtain Privacy
Pass tokens from a real `confed issuer` (dev attester) and fill a round of a task that requires
them; the release counts them as authenticated. Devices without an attestation, or whose trust
file does not list the issuer, decline. The blind RSA half matches the RFC 9578 vectors."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess
import threading

import numpy as np
import pytest
import requests

from confed_client import Device, DeviceError, Partner, Trust, envelope, run_simulation, tokens
from confed_client.policy import parse_policy, policy_sha256

ROOT = pathlib.Path(__file__).resolve().parents[3]
DEVICES = 4


@pytest.fixture(scope="module")
def issuer(tmp_path_factory):
    binary = os.environ.get("CONFED_BIN", str(ROOT / "target" / "debug" / "confed"))
    state = tmp_path_factory.mktemp("issuer")
    key = state / "token-key.pem"
    subprocess.run([binary, "issuer", "generate-key", str(key)], check=True,
                   capture_output=True)
    process = subprocess.Popen(
        [binary, "issuer", "--name", "py-issuer", "--attester", "dev", "--signing-key", str(key),
         "--state", str(state / "state"), "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "RUST_LOG": "error"})
    line = process.stdout.readline()
    assert line.startswith("confed: serving on "), line
    threading.Thread(target=lambda: [None for _ in process.stdout], daemon=True).start()
    url = line.removeprefix("confed: serving on ").strip()
    directory = requests.get(f"{url}/v1/directory", timeout=10).json()
    try:
        yield {"url": url, "name": directory["issuer_name"],
               "token_key": directory["token-keys"][0]["token-key"]}
    finally:
        process.terminate()
        process.wait(timeout=30)


def spec(population: str, issuer: dict) -> dict:
    return {"upload_window": {"start_ms": 300, "end_ms": 500}, "population": population, "rounds": 1, "report_goal": DEVICES,
            "min_reports": DEVICES,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
            "device_auth": {"issuer": issuer["name"], "token_keys": [issuer["token_key"]]}}


def trusting(server: dict, issuer: dict) -> Trust:
    trust = Trust.load(server["trust"])
    trust.token_issuers = {issuer["name"]: {"token_keys": [tokens.unb64url(issuer["token_key"])],
                                            "url": issuer["url"]}}
    return trust


def test_python_devices_with_tokens_fill_a_round_that_counts_them_authenticated(server, issuer):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(spec("python-tokens", issuer), {"w": np.zeros(8, np.float32)})
    trust = trusting(server, issuer)
    for _ in range(DEVICES):
        device = Device(server["url"], "python-tokens", trust,
                        attestation=tokens.DevAttestation())
        assert device.run_once(lambda w, plan: {"w": np.full(8, 0.1, np.float32)}) == "contributed"
    release = partner.wait_for_release(task, 1)
    manifest = release["manifest"]
    manifest = json.loads(manifest) if isinstance(manifest, str) else manifest
    assert manifest["included"] == DEVICES
    assert manifest["authenticated"] == DEVICES


def test_python_devices_mask_their_updates_and_the_release_says_it_was_masked(server, issuer):
    """`secure_aggregation`: each Python device clips on the grid, masks its update with seeds
    sealed to the key services and binds them in its token; the key services remove the masks of
    the round's agreed set, and the release records the masking."""
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(dict(spec("python-masked", issuer), secure_aggregation=True),
                               {"w": np.zeros(8, np.float32)})
    trust = trusting(server, issuer)
    for _ in range(DEVICES):
        device = Device(server["url"], "python-masked", trust,
                        attestation=tokens.DevAttestation())
        assert device.run_once(lambda w, plan: {"w": np.full(8, 0.1, np.float32)}) == "contributed"
    release = partner.wait_for_release(task, 1)
    manifest = release["manifest"]
    manifest = json.loads(manifest) if isinstance(manifest, str) else manifest
    assert manifest["included"] == DEVICES
    assert manifest["authenticated"] == DEVICES
    masking = manifest["masking"]
    assert masking["scheme"] == "confed-masking/v1"
    assert masking["answered"] == list(range(1, masking["services"] + 1))


def test_devices_without_attestation_or_trust_in_the_issuer_decline(server, issuer):
    partner = Partner(server["url"], server["token"])
    partner.create_task(spec("python-tokens-refused", issuer), {"w": np.zeros(4, np.float32)})
    without_issuer = Device(server["url"], "python-tokens-refused", Trust.load(server["trust"]),
                            attestation=tokens.DevAttestation())
    with pytest.raises(Exception, match="device_auth"):
        without_issuer.contribute(without_issuer.check_in(), lambda w, plan: w)
    without_attestation = Device(server["url"], "python-tokens-refused",
                                 trusting(server, issuer))
    with pytest.raises(DeviceError, match="attestation"):
        without_attestation.contribute(without_attestation.check_in(), lambda w, plan: w)


def test_a_device_that_cannot_get_a_token_waits_a_retry_window_before_checking_in_again(
        server, issuer):
    partner = Partner(server["url"], server["token"])
    partner.create_task(spec("python-tokens-backoff", issuer), {"w": np.zeros(4, np.float32)})
    trust = trusting(server, issuer)
    # The issuer the trust file names is unreachable: no token, the assignment fails.
    trust.token_issuers[issuer["name"]]["url"] = "http://127.0.0.1:9"
    waits = []
    device = Device(server["url"], "python-tokens-backoff", trust,
                    attestation=tokens.DevAttestation(), sleep=waits.append)
    train = lambda w, plan: {"w": np.full(4, 0.1, np.float32)}  # noqa: E731
    for _ in range(2):
        with pytest.raises(Exception):
            device.run_once(train)
    # The first failure is reported at once; the second check-in came only after a wait of
    # 60-120 s (the first wait run_once made), not in a loop.
    assert 55 <= waits[0] <= 120, waits


def test_the_blind_rsa_half_matches_the_rfc_9578_vectors():
    vectors = json.loads((ROOT / "protocol/testdata/privacy_pass_type2_vectors.json").read_text())
    for vector in vectors:
        spki = bytes.fromhex(vector["pkS"])
        token = bytes.fromhex(vector["token"])
        pending = tokens.PendingToken(token[:98], bytes.fromhex(vector["token_request"])[3:],
                                      int(vector["unblinder"], 16))
        assert tokens.finish(spki, pending, bytes.fromhex(vector["token_response"])) == token
    # The confed context and nonce, as docs/protocol.md spells them.
    assert tokens.redemption_context("task-a", 3, "ab") == __import__("hashlib").sha256(
        b"confed token context v1\x00task-a\x003\x00ab\x00").digest()


def test_a_policy_with_a_non_canonical_token_key_and_a_trust_file_listing_an_issuer_twice_are_refused(
        tmp_path, server):
    from confed_client import PolicyError
    from confed_client.policy import _device_auth
    vector = json.loads((ROOT / "protocol/testdata/privacy_pass_type2_vectors.json").read_text())[0]
    key = tokens.b64url(bytes.fromhex(vector["pkS"]))
    assert _device_auth(f"device_auth=privacy_pass;issuer=i;token_keys={key}")["issuer"] == "i"
    for bad in (f"device_auth=privacy_pass;issuer=i;token_keys={key}=",
                f"device_auth=privacy_pass;issuer=i;token_keys={key[:-1]}*",
                "device_auth=privacy_pass;issuer=i"):
        with pytest.raises(PolicyError):
            _device_auth(bad)
    with pytest.raises(tokens.TokenError, match="RSASSA-PSS"):
        tokens.issuer_public_key(bytes.fromhex(vector["pkS"]).replace(
            bytes([0x01, 0x01, 0x0A]), bytes([0x01, 0x01, 0x01]), 1))
    raw = json.loads(pathlib.Path(server["trust"]).read_text())
    issuer_entry = {"name": "twice", "token_keys": [key], "url": "http://127.0.0.1:1"}
    raw["token_issuers"] = [issuer_entry, issuer_entry]
    path = tmp_path / "trust.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="twice"):
        Trust.load(str(path))


def test_run_simulation_gives_each_device_its_attestation_and_the_round_counts_them(
        server, issuer):
    partner = Partner(server["url"], server["token"])
    task = partner.create_task(dict(spec("python-tokens-sim", issuer), rounds=2),
                               {"w": np.zeros(4, np.float32)})
    history = run_simulation(partner, task, trusting(server, issuer),
                             lambda i: (lambda w, plan: {"w": np.full(4, 0.1, np.float32)}),
                             num_devices=2 * DEVICES, progress=False, max_wait=0.05,
                             attestation_fn=lambda i: tokens.DevAttestation())
    assert len(history) == 2
    for round_ in (1, 2):
        manifest = partner.wait_for_release(task, round_)["manifest"]
        manifest = json.loads(manifest) if isinstance(manifest, str) else manifest
        assert manifest["authenticated"] == DEVICES


def test_a_token_obtained_for_one_assignment_is_refused_on_another(server, issuer):
    partner = Partner(server["url"], server["token"])
    partner.create_task(dict(spec("python-tokens-moved", issuer), report_goal=2, min_reports=2),
                        {"w": np.zeros(4, np.float32)})
    trust = trusting(server, issuer)
    device = Device(server["url"], "python-tokens-moved", trust,
                    attestation=tokens.DevAttestation())
    first, second = device.check_in(), device.check_in()
    assert first["assignment_id"] != second["assignment_id"]
    policy = parse_policy(second["policy"])
    eks, token, _ = device._token(policy, first)  # a token for the first assignment
    public_key = trust.verify_key(second["encryption"], __import__("time").time())
    model = requests.get(server["url"] + second["model_url"], timeout=30).content
    sealed = envelope.seal_update(
        public_key, second["encryption"]["key_id"],
        envelope.aad(second["task_id"], second["round"], second["assignment_id"],
                     policy_sha256(second["policy"]), __import__("hashlib").sha256(model).hexdigest()),
        model, eks=eks, token=token)
    reply = requests.put(server["url"] + second["upload_url"], data=sealed,
                         headers={"content-type": "application/cbor"}, timeout=30)
    assert reply.status_code == 403, reply.text
    assert reply.json()["type"] == "urn:confed:problem:token-refused"
    # Without a token: 401 with the RFC 9577 challenge for this assignment.
    plain = envelope.seal_update(
        public_key, second["encryption"]["key_id"],
        envelope.aad(second["task_id"], second["round"], second["assignment_id"],
                     policy_sha256(second["policy"]), __import__("hashlib").sha256(model).hexdigest()),
        model)
    reply = requests.put(server["url"] + second["upload_url"], data=plain,
                         headers={"content-type": "application/cbor"}, timeout=30)
    assert reply.status_code == 401, reply.text
    assert reply.headers["www-authenticate"].startswith("PrivateToken challenge=")


def test_android_key_attestation_sends_the_platforms_chain_as_base64url():
    pem = (ROOT / "issuer" / "testdata" / "android" / "tegu_sdk36_TEE_EC_2026_ROOT.pem").read_text()
    from cryptography import x509
    from cryptography.hazmat.primitives.serialization import Encoding
    chain = [c.public_bytes(Encoding.DER) for c in x509.load_pem_x509_certificates(pem.encode())]
    seen = []
    evidence = tokens.AndroidKeyAttestation(lambda c: seen.append(c) or chain).evidence(b"fresh")
    assert seen == [b"fresh"]
    assert evidence["format"] == "android-key-attestation"
    assert [tokens.unb64url(c) for c in evidence["certificate_chain"]] == chain
    assert all("=" not in c and "+" not in c and "/" not in c for c in evidence["certificate_chain"])


def test_apple_app_attest_keeps_one_key_and_drops_it_only_when_apple_or_the_issuer_say_so():
    calls = []
    failures = []

    def generate_key():
        calls.append("generate")
        return bytes([len(calls)]) * 32

    def attest_key(key_id, client_data_hash):
        calls.append(f"attest {key_id[0]}")
        if failures:
            raise failures.pop()
        return client_data_hash

    def generate_assertion(key_id, client_data_hash):
        calls.append(f"assert {key_id[0]}")
        if failures:
            raise failures.pop()
        return client_data_hash

    attestation = tokens.AppleAppAttest(generate_key, attest_key, generate_assertion)
    # Apple's server unavailable: the same key is attested at the next try.
    failures.append(tokens.AppAttestServerUnavailable("down"))
    with pytest.raises(tokens.AppAttestServerUnavailable):
        attestation.evidence(b"c0")
    first = attestation.evidence(b"c1")
    assert first["format"] == "apple-app-attest" and "assertion" not in first
    # clientDataHash = SHA-256("confed-app-attest-v1" 0x00 || challenge), as the issuer checks it.
    assert tokens.unb64url(first["attestation"]) == hashlib.sha256(
        b"confed-app-attest-v1\x00c1").digest()
    assert attestation.state == "sent"
    attestation.accepted()
    assert attestation.state == "accepted"
    second = attestation.evidence(b"c2")
    assert "attestation" not in second and second["key_id"] == first["key_id"]
    attestation.refused(["rp_id"])  # not about the key: kept
    attestation.evidence(b"c3")
    attestation.refused(["counter"])  # the key itself: a new one next time
    attestation.evidence(b"c4")
    assert calls == ["generate", "attest 1", "attest 1", "assert 1", "assert 1", "generate",
                     "attest 6"]
    # A kept key the platform no longer has: dropped, and a new one attested next time.
    calls.clear()
    restored = tokens.AppleAppAttest(generate_key, attest_key, generate_assertion,
                                     key_id=b"\x09" * 32)
    failures.append(tokens.AppAttestInvalidKey("gone"))
    with pytest.raises(tokens.AppAttestInvalidKey):
        restored.evidence(b"c")
    restored.evidence(b"c")
    assert calls == ["assert 9", "generate", "attest 2"]
