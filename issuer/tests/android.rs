#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The Android key attestation attester against real chains (Pixel devices, recorded by
//! android/keyattestation, under Google's roots) and against generated chains of the same shape
//! under a test root, one refusal per check; then the whole issuance over HTTP with it.

mod support;

use support::http::{challenge, refused_checks, token_request};

use std::sync::Arc;

use axum::http::StatusCode;
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_issuer::Issuer;
use confed_issuer::attester::android::revocation::StatusList;
use confed_issuer::attester::android::{
    AllowedApp, AndroidAttester, AndroidPolicy, google_root_keys, root_keys_from_pem,
};
use confed_issuer::attester::{Attester, Evidence};
use confed_issuer::limiter::Limiter;
use confed_issuer::routes::{self, TokenRequestBody, TokenResponseBody};
use confed_protocol::clock::ManualClock;
use confed_protocol::clock::Seconds;
use confed_protocol::privacy_pass::issuance::{TokenClient, TokenSigner};
use rcgen::KeyPair;
use support::android_chain::{ChainSpec, PACKAGE, SIGNATURE_DIGEST, TestPki, chain_from_pem, now};

const TEGU: &str = include_str!("../testdata/android/tegu_sdk36_TEE_EC_2026_ROOT.pem");
const CAIMAN: &str = include_str!("../testdata/android/caiman_sdk36_TEE_EC_RKP.pem");
const BLUELINE: &str = include_str!("../testdata/android/blueline_sdk28_TEE_EC_NONE.pem");
const TEGU_CHALLENGE: &[u8] = b"6417f92c-daef-4cc1-8828-5bb39338ffd5";
const CAIMAN_CHALLENGE: &[u8] = b"d688d763-6118-4ca6-94b2-e6cd9ed7e4e4";
/// The samples' app: Google's attestation collector and its signing certificate's digest.
const SAMPLE_APP: &str = "com.google.android.attestation:103938ee4537e59e8ee792f654504fb8346fc6b346d0bbc4415fc339fcfc8ec1";
/// 2026-03-01 and 2025-09-30, inside the samples' RKP attestation key validity.
const TEGU_TIME: i64 = 1_772_323_200;
const CAIMAN_TIME: i64 = 1_759_190_400;

fn google_attester(apps: &[&str], status: &str) -> AndroidAttester {
    AndroidAttester::new(AndroidPolicy {
        trusted_roots: google_root_keys(),
        apps: apps.iter().map(|a| a.parse().unwrap()).collect(),
        status_list: StatusList::parse(status.as_bytes()).unwrap(),
        min_os_patch_level: None,
    })
    .unwrap()
}

fn test_attester(pki: &TestPki, min_os_patch_level: Option<i64>) -> AndroidAttester {
    AndroidAttester::new(AndroidPolicy {
        trusted_roots: root_keys_from_pem(pki.root_pem.as_bytes()).unwrap(),
        apps: vec![AllowedApp {
            package: PACKAGE.into(),
            signature_digest: SIGNATURE_DIGEST,
        }],
        status_list: StatusList::default(),
        min_os_patch_level,
    })
    .unwrap()
}

fn evidence(chain: Vec<String>) -> Evidence {
    Evidence::AndroidKeyAttestation {
        certificate_chain: chain,
    }
}

const NO_REVOCATIONS: &str = r#"{"entries": {}}"#;

#[test]
fn real_pixel_rkp_chains_under_both_google_roots_attest() {
    let attester = google_attester(&[SAMPLE_APP], NO_REVOCATIONS);
    let tegu = attester
        .attest(
            &evidence(chain_from_pem(TEGU)),
            TEGU_CHALLENGE,
            Seconds(TEGU_TIME),
        )
        .unwrap();
    let caiman = attester
        .attest(
            &evidence(chain_from_pem(CAIMAN)),
            CAIMAN_CHALLENGE,
            Seconds(CAIMAN_TIME),
        )
        .unwrap();
    assert_ne!(tegu, caiman, "two devices are two identities");
    assert_eq!(
        attester
            .attest(
                &evidence(chain_from_pem(TEGU)),
                TEGU_CHALLENGE,
                Seconds(TEGU_TIME + 60)
            )
            .unwrap(),
        tegu
    );
}

#[test]
fn a_real_factory_provisioned_chain_is_refused_because_its_key_is_a_batch_key() {
    let attester = google_attester(&[SAMPLE_APP], NO_REVOCATIONS);
    let blueline = chain_from_pem(BLUELINE);
    assert_eq!(blueline.len(), 4);
    assert_eq!(
        refused_checks(attester.attest(&evidence(blueline), b"challenge", Seconds(TEGU_TIME))),
        ["provisioning"]
    );
}

#[test]
fn a_real_chain_with_another_challenge_app_time_or_a_revoked_key_is_refused() {
    let attester = google_attester(&[SAMPLE_APP], NO_REVOCATIONS);
    let tegu = || evidence(chain_from_pem(TEGU));
    assert_eq!(
        refused_checks(attester.attest(&tegu(), b"a fresh issuer challenge", Seconds(TEGU_TIME))),
        ["challenge"]
    );
    let another_app = "com.example.fl:".to_owned() + &"5a".repeat(32);
    let other_app = google_attester(&[another_app.as_str()], NO_REVOCATIONS);
    let refused = other_app
        .attest(&tegu(), TEGU_CHALLENGE, Seconds(TEGU_TIME))
        .unwrap_err();
    let refused = refused.checks();
    assert_eq!(refused[0].check, "application");
    assert!(refused[0].reason.contains("com.google.android.attestation"));
    // The RKP attestation key's certificate lived two weeks: after it, the chain is stale.
    assert_eq!(
        refused_checks(attester.attest(&tegu(), TEGU_CHALLENGE, Seconds(TEGU_TIME + 30 * 86_400))),
        ["validity"]
    );
    let revoked = google_attester(
        &[SAMPLE_APP],
        r#"{"entries": {"2c85cdc15c3042f25698906669c35137": {"status": "REVOKED", "reason": "KEY_COMPROMISE"}}}"#,
    );
    assert_eq!(
        refused_checks(revoked.attest(&tegu(), TEGU_CHALLENGE, Seconds(TEGU_TIME))),
        ["revocation"]
    );
}

#[test]
fn a_real_chain_with_a_changed_byte_or_a_missing_link_is_refused() {
    let attester = google_attester(&[SAMPLE_APP], NO_REVOCATIONS);
    let mut chain = chain_from_pem(TEGU);
    // Flip a bit in the leaf's key description (the challenge's last byte): the signature of
    // the attestation key no longer covers it.
    let mut leaf = URL_SAFE_NO_PAD.decode(&chain[0]).unwrap();
    let at = leaf
        .windows(TEGU_CHALLENGE.len())
        .position(|w| w == TEGU_CHALLENGE)
        .unwrap()
        + TEGU_CHALLENGE.len()
        - 1;
    leaf[at] ^= 1;
    let mut edited = TEGU_CHALLENGE.to_vec();
    *edited.last_mut().unwrap() ^= 1;
    chain[0] = URL_SAFE_NO_PAD.encode(&leaf);
    assert_eq!(
        refused_checks(attester.attest(&evidence(chain), &edited, Seconds(TEGU_TIME))),
        ["chain_signatures"]
    );
    let mut missing = chain_from_pem(TEGU);
    missing.remove(2);
    assert_eq!(
        refused_checks(attester.attest(&evidence(missing), TEGU_CHALLENGE, Seconds(TEGU_TIME))),
        ["chain_signatures"]
    );
    // The CAIMAN chain's root in place of the TEGU chain's: not the issuer of its Droid CA2.
    let mut swapped = chain_from_pem(TEGU);
    *swapped.last_mut().unwrap() = chain_from_pem(CAIMAN).pop().unwrap();
    assert_eq!(
        refused_checks(attester.attest(&evidence(swapped), TEGU_CHALLENGE, Seconds(TEGU_TIME))),
        ["chain_signatures"]
    );
}

#[test]
fn a_genuine_generated_chain_attests_and_its_attestation_key_is_the_identity() {
    let pki = TestPki::new();
    let attester = test_attester(&pki, Some(202_601));
    let device = KeyPair::generate().unwrap();
    let spec = ChainSpec::genuine(b"c1");
    let first = attester
        .attest(&evidence(pki.chain(&device, &spec)), b"c1", now())
        .unwrap();
    // A new leaf key of the same device (same RKP attestation key) is the same device.
    let again = attester
        .attest(
            &evidence(pki.chain(&device, &ChainSpec::genuine(b"c2"))),
            b"c2",
            now(),
        )
        .unwrap();
    assert_eq!(first, again);
    let other = attester
        .attest(
            &evidence(pki.chain(&KeyPair::generate().unwrap(), &spec)),
            b"c1",
            now(),
        )
        .unwrap();
    assert_ne!(first, other);
    // Real devices have encoded deviceLocked TRUE as 0x01 (BER, not DER): still locked.
    let mut quirk = ChainSpec::genuine(b"c3");
    quirk.description.locked_byte = 0x01;
    assert_eq!(
        attester
            .attest(&evidence(pki.chain(&device, &quirk)), b"c3", now())
            .unwrap(),
        first
    );
}

/// Each case changes one field of a genuine chain; the refusal names exactly that check.
#[test]
fn each_generated_refusal_names_the_check_that_failed() {
    let pki = TestPki::new();
    let attester = test_attester(&pki, Some(202_601));
    let device = KeyPair::generate().unwrap();
    let challenge = b"fresh".as_slice();
    type Edit = fn(&mut ChainSpec);
    let cases: Vec<(&str, Edit, &[&str])> = vec![
        (
            "unverified boot",
            |s| s.description.boot_state = 2,
            &["verified_boot"],
        ),
        (
            "self-signed boot",
            |s| s.description.boot_state = 1,
            &["verified_boot"],
        ),
        (
            "unlocked bootloader",
            |s| s.description.locked_byte = 0,
            &["device_locked"],
        ),
        (
            "unlocked and unverified",
            |s| {
                s.description.locked_byte = 0;
                s.description.boot_state = 2;
            },
            &["verified_boot", "device_locked"],
        ),
        (
            "wrong package",
            |s| s.description.packages = vec!["com.attacker.app".into()],
            &["application"],
        ),
        (
            "right package, another signing key",
            |s| s.description.digests = vec![[0x11; 32]],
            &["application"],
        ),
        (
            "stale challenge",
            |s| s.description.challenge = b"stale".to_vec(),
            &["challenge"],
        ),
        (
            "software keystore",
            |s| s.description.attestation_level = 0,
            &["security_level"],
        ),
        (
            "software keymint",
            |s| s.description.keymint_level = 0,
            &["security_level"],
        ),
        (
            "root of trust only in the software-enforced list",
            |s| s.description.root_of_trust_in_hardware_list = false,
            &["verified_boot"],
        ),
        (
            "two roots of trust",
            |s| s.description.duplicate_root_of_trust = true,
            &["verified_boot"],
        ),
        (
            "old patch level",
            |s| s.description.os_patch_level = 202_512,
            &["os_patch_level"],
        ),
        (
            "factory-provisioned key",
            |s| s.remotely_provisioned = false,
            &["provisioning"],
        ),
        (
            "key description above the leaf",
            |s| s.description_on_attestation_key = true,
            &["key_description"],
        ),
        (
            "expired attestation key",
            |s| s.attestation_key_valid = ((2026, 5, 1), (2026, 5, 15)),
            &["validity"],
        ),
        (
            "no key description on the leaf",
            |s| s.leaf_descriptions = 0,
            &["key_description"],
        ),
        (
            "two key descriptions on the leaf",
            |s| s.leaf_descriptions = 2,
            &["key_description"],
        ),
        (
            "no attestation application id",
            |s| s.description.with_application_id = false,
            &["application"],
        ),
        (
            "no patch level while a minimum is set",
            |s| s.description.with_os_patch_level = false,
            &["os_patch_level"],
        ),
        (
            "attestation key not yet valid",
            |s| s.attestation_key_valid = ((2026, 6, 2), (2026, 6, 16)),
            &["validity"],
        ),
    ];
    for (name, edit, expected) in cases {
        let mut spec = ChainSpec::genuine(challenge);
        edit(&mut spec);
        let refused = attester
            .attest(&evidence(pki.chain(&device, &spec)), challenge, now())
            .expect_err(name);
        let checks: Vec<_> = refused.checks().iter().map(|f| f.check).collect();
        assert_eq!(checks, expected, "{name}: {refused:?}");
    }
}

#[test]
fn the_leafs_own_dates_are_ignored_but_an_expired_intermediate_is_refused() {
    let device = KeyPair::generate().unwrap();
    let pki = TestPki::new();
    let mut expired_leaf = ChainSpec::genuine(b"c");
    expired_leaf.leaf_valid = ((2020, 1, 1), (2021, 1, 1));
    test_attester(&pki, None)
        .attest(&evidence(pki.chain(&device, &expired_leaf)), b"c", now())
        .unwrap();
    let stale = TestPki::with_intermediate_valid((2025, 1, 1), (2026, 5, 1));
    assert_eq!(
        refused_checks(test_attester(&stale, None).attest(
            &evidence(stale.chain(&device, &ChainSpec::genuine(b"c"))),
            b"c",
            now()
        )),
        ["validity"]
    );
}

#[test]
fn a_package_and_a_digest_of_two_different_allowed_apps_do_not_make_an_allowed_app() {
    let pki = TestPki::new();
    let attester = AndroidAttester::new(AndroidPolicy {
        apps: vec![
            AllowedApp {
                package: PACKAGE.into(),
                signature_digest: [0x11; 32],
            },
            AllowedApp {
                package: "com.example.other".into(),
                signature_digest: SIGNATURE_DIGEST,
            },
        ],
        ..test_policy(&pki)
    })
    .unwrap();
    let device = KeyPair::generate().unwrap();
    assert_eq!(
        refused_checks(attester.attest(
            &evidence(pki.chain(&device, &ChainSpec::genuine(b"c"))),
            b"c",
            now()
        )),
        ["application"]
    );
}

#[test]
fn a_status_list_file_is_reloaded_when_it_changes_and_refused_when_stale() {
    use confed_issuer::attester::android::revocation::StatusFile;
    use std::time::{Duration, UNIX_EPOCH};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    let write = |json: &str, written_at: i64| {
        std::fs::write(&path, json).unwrap();
        std::fs::File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_modified(UNIX_EPOCH + Duration::from_secs(written_at as u64))
            .unwrap();
    };
    write(NO_REVOCATIONS, now().0 - 3600);
    let pki = TestPki::new();
    let attester = AndroidAttester::new(test_policy(&pki))
        .unwrap()
        .with_status_file(StatusFile::open(&path, 48 * 3600).unwrap());
    let device = KeyPair::generate().unwrap();
    let chain = || evidence(pki.chain(&device, &ChainSpec::genuine(b"c")));
    assert_eq!(attester.unavailable(now()), None);
    attester.attest(&chain(), b"c", now()).unwrap();
    // The operator's cron fetches a list naming this device's attestation key (serial 2c85cdc1).
    write(
        r#"{"entries": {"2c85cdc1": {"status": "REVOKED", "reason": "KEY_COMPROMISE"}}}"#,
        now().0 - 60,
    );
    assert_eq!(attester.unavailable(now()), None);
    assert_eq!(
        refused_checks(attester.attest(&chain(), b"c", now())),
        ["revocation"]
    );
    // A broken copy keeps the loaded list; once that is older than the limit, attestation stops.
    write("{", now().0 - 30);
    assert_eq!(attester.unavailable(now()), None);
    assert_eq!(
        refused_checks(attester.attest(&chain(), b"c", now())),
        ["revocation"]
    );
    let stale = attester.unavailable(Seconds(now().0 + 49 * 3600)).unwrap();
    assert!(stale.contains("hours old"), "{stale}");
}

#[test]
fn a_serial_with_a_leading_zero_octet_is_looked_up_without_it() {
    // Google's EC root has serial 0x84a9..., encoded 00 84 a9 ...; the list keys it without 00.
    let revoked = google_attester(
        &[SAMPLE_APP],
        r#"{"entries": {"84a9d0297b0eb58ae7ff0e80de760605": {"status": "REVOKED"}}}"#,
    );
    assert_eq!(
        refused_checks(revoked.attest(
            &evidence(chain_from_pem(TEGU)),
            TEGU_CHALLENGE,
            Seconds(TEGU_TIME)
        )),
        ["revocation"]
    );
}

#[test]
fn broken_or_foreign_generated_chains_are_refused() {
    let pki = TestPki::new();
    let attester = test_attester(&pki, None);
    let device = KeyPair::generate().unwrap();
    let spec = ChainSpec::genuine(b"c");
    // The leaf of one device under another device's attestation key certificate.
    let mut spliced = pki.chain(&device, &spec);
    spliced[1] = pki.chain(&KeyPair::generate().unwrap(), &spec)[1].clone();
    assert_eq!(
        refused_checks(attester.attest(&evidence(spliced), b"c", now())),
        ["chain_signatures"]
    );
    // A chain of the same shape under another root.
    let foreign = TestPki::new().chain(&device, &spec);
    assert_eq!(
        refused_checks(attester.attest(&evidence(foreign), b"c", now())),
        ["root"]
    );
    // Google's attester does not trust the test root.
    let google = google_attester(&[SAMPLE_APP], NO_REVOCATIONS);
    assert_eq!(
        refused_checks(google.attest(&evidence(pki.chain(&device, &spec)), b"c", now())),
        ["root"]
    );
    let revoked = AndroidAttester::new(AndroidPolicy {
        status_list: StatusList::parse(br#"{"entries": {"2c85cdc1": {"status": "SUSPENDED"}}}"#)
            .unwrap(),
        ..test_policy(&pki)
    })
    .unwrap();
    assert_eq!(
        refused_checks(revoked.attest(&evidence(pki.chain(&device, &spec)), b"c", now())),
        ["revocation"]
    );
    for (name, chain) in [
        (
            "one certificate",
            vec![pki.chain(&device, &spec)[0].clone()],
        ),
        ("not base64url", vec!["%%".into(), "%%".into()]),
        ("not DER", vec!["AAAA".into(), "AAAA".into()]),
        (
            "eleven certificates",
            vec![pki.chain(&device, &spec)[0].clone(); 11],
        ),
    ] {
        assert_eq!(
            refused_checks(attester.attest(&evidence(chain), b"c", now())),
            ["certificate_chain"],
            "{name}"
        );
    }
    let dev = Evidence::dev(
        &p256::ecdsa::SigningKey::from_slice(&[1; 32]).unwrap(),
        b"c",
    );
    assert_eq!(
        refused_checks(attester.attest(&dev, b"c", now())),
        ["format"]
    );
}

fn test_policy(pki: &TestPki) -> AndroidPolicy {
    AndroidPolicy {
        trusted_roots: root_keys_from_pem(pki.root_pem.as_bytes()).unwrap(),
        apps: vec![AllowedApp {
            package: PACKAGE.into(),
            signature_digest: SIGNATURE_DIGEST,
        }],
        status_list: StatusList::default(),
        min_os_patch_level: None,
    }
}

#[test]
fn allowed_apps_parse_from_package_and_digest_and_bad_ones_say_what_to_write() {
    let app: AllowedApp = SAMPLE_APP.parse().unwrap();
    assert_eq!(app.package, "com.google.android.attestation");
    let no_package = ":".to_owned() + &"00".repeat(32);
    for bad in ["com.example", "com.example:abcd", no_package.as_str()] {
        let error = bad.parse::<AllowedApp>().unwrap_err().to_string();
        assert!(error.contains("PACKAGE:SHA256HEX"), "{error}");
    }
    assert!(
        AndroidAttester::new(AndroidPolicy {
            apps: vec![],
            ..test_policy(&TestPki::new())
        })
        .is_err()
    );
}

#[tokio::test]
async fn an_android_device_attests_over_http_and_its_allowance_follows_its_attestation_key() {
    const L: u32 = 2;
    let signer = TokenSigner::generate().unwrap();
    let client = TokenClient::from_spki(signer.spki()).unwrap();
    let pki = TestPki::new();
    let state = tempfile::tempdir().unwrap();
    let issuer = Issuer::new(
        "issuer.test".into(),
        signer,
        Box::new(test_attester(&pki, None)),
        Limiter::open(state.path(), L, 86_400).unwrap(),
        86_400,
        Arc::new(ManualClock::starting_at(now().millis())),
    )
    .unwrap();
    let app = routes::router(Arc::new(issuer));
    let device = KeyPair::generate().unwrap();
    let ask = |challenge: &[u8], device: &KeyPair, tokens: usize| {
        let mut spec = ChainSpec::genuine(challenge);
        spec.description.challenge = challenge.to_vec();
        serde_json::to_string(&TokenRequestBody {
            challenge: Some(URL_SAFE_NO_PAD.encode(challenge)),
            evidence: Some(evidence(pki.chain(device, &spec))),
            credential: None,
            token_requests: (0..tokens)
                .map(|_| URL_SAFE_NO_PAD.encode(client.begin(b"round").unwrap().0.encode()))
                .collect(),
        })
        .unwrap()
    };

    let c = challenge(&app).await;
    let (status, body) = token_request(&app, ask(&c, &device, 2)).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let answer: TokenResponseBody = serde_json::from_slice(&body).unwrap();
    assert_eq!((answer.token_responses.len(), answer.remaining), (2, 0));

    // A new leaf key (a new challenge) of the same device draws on the same allowance.
    let c = challenge(&app).await;
    let (status, _) = token_request(&app, ask(&c, &device, 1)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // Another device has its own.
    let c = challenge(&app).await;
    let (status, _) = token_request(&app, ask(&c, &KeyPair::generate().unwrap(), 1)).await;
    assert_eq!(status, StatusCode::OK);

    // An unlocked device is refused with the check named, as problem+json.
    let c = challenge(&app).await;
    let mut spec = ChainSpec::genuine(&c);
    spec.description.locked_byte = 0;
    let body = serde_json::to_string(&TokenRequestBody {
        challenge: Some(URL_SAFE_NO_PAD.encode(&c)),
        evidence: Some(evidence(pki.chain(&KeyPair::generate().unwrap(), &spec))),
        credential: None,
        token_requests: vec![URL_SAFE_NO_PAD.encode(client.begin(b"round").unwrap().0.encode())],
    })
    .unwrap();
    let (status, problem) = token_request(&app, body).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let problem: serde_json::Value = serde_json::from_slice(&problem).unwrap();
    assert_eq!(
        problem["failed_checks"][0]["check"], "device_locked",
        "{problem}"
    );
}

#[tokio::test]
async fn an_issuer_whose_status_list_went_stale_answers_503_and_grants_nothing() {
    use confed_issuer::attester::android::revocation::StatusFile;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("status.json");
    std::fs::write(&path, NO_REVOCATIONS).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(std::time::UNIX_EPOCH + std::time::Duration::from_secs(now().0 as u64))
        .unwrap();
    let pki = TestPki::new();
    let clock = Arc::new(ManualClock::starting_at(now().millis()));
    let issuer = Issuer::new(
        "issuer.test".into(),
        TokenSigner::generate().unwrap(),
        Box::new(
            test_attester(&pki, None).with_status_file(StatusFile::open(&path, 48 * 3600).unwrap()),
        ),
        Limiter::open(&dir.path().join("state"), 2, 86_400).unwrap(),
        86_400,
        clock.clone(),
    )
    .unwrap();
    let client = TokenClient::from_spki(issuer.signer().spki()).unwrap();
    let app = routes::router(Arc::new(issuer));
    clock.advance(std::time::Duration::from_secs(49 * 3600));
    let challenge = challenge(&app).await;
    let body = serde_json::to_string(&TokenRequestBody {
        challenge: Some(URL_SAFE_NO_PAD.encode(&challenge)),
        evidence: Some(evidence(pki.chain(
            &KeyPair::generate().unwrap(),
            &ChainSpec::genuine(&challenge),
        ))),
        credential: None,
        token_requests: vec![URL_SAFE_NO_PAD.encode(client.begin(b"round").unwrap().0.encode())],
    })
    .unwrap();
    let (status, problem) = token_request(&app, body).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let problem: serde_json::Value = serde_json::from_slice(&problem).unwrap();
    assert!(
        problem["detail"].as_str().unwrap().contains("status list"),
        "{problem}"
    );
}
