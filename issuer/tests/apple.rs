#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The Apple App Attest attester against a real attestation and assertion (iOS 14.4, recorded by
//! veehaitch/devicecheck-appattest, under Apple's root) and against generated evidence of the same
//! shape under a test root, one refusal per check; then the whole issuance over HTTP with it.

#[path = "support/app_attest.rs"]
mod app_attest;
#[path = "support/http.rs"]
mod http;

use std::sync::Arc;

use app_attest::{
    APP_ID, AttestationSpec, TestApple, TestDevice, assertion_evidence, attestation_evidence,
};
use axum::http::StatusCode;
use base64::Engine as _;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use confed_issuer::Issuer;
use confed_issuer::attester::apple::registry::{Registered, Registry};
use confed_issuer::attester::apple::{
    AllowedAppId, AppleAttester, ApplePolicy, apple_roots, root_certificates_from_pem,
};
use confed_issuer::attester::several::Attesters;
use confed_issuer::attester::{Attester, Evidence};
use confed_issuer::limiter::Limiter;
use confed_issuer::routes::{self, TokenRequestBody, TokenResponseBody};
use confed_protocol::clock::{ManualClock, Seconds};
use confed_protocol::privacy_pass::issuance::{TokenClient, TokenSigner};
use confed_protocol::privacy_pass::issuer_api::app_attest_client_data_hash;
use http::{call, challenge, refused_checks, token_request};

const SAMPLE: &str = include_str!("../testdata/apple/ios-14.4.json");
const SAMPLE_APP: &str = "6MURL8TA57.de.vincent-haupert.apple-appattest-poc";
/// 2021-01-24 00:00 UTC, inside the sample's credential certificate validity.
const SAMPLE_TIME: Seconds = Seconds(1_611_446_400);
/// 2026-06-01 00:00 UTC, inside the generated certificates' validity.
const NOW: Seconds = Seconds(1_780_272_000);

fn registry(dir: &std::path::Path) -> Registry {
    Registry::open(dir, ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[3; 32])).unwrap()
}

fn attester(
    roots: Vec<Vec<u8>>,
    apps: &[&str],
    development: bool,
    dir: &std::path::Path,
) -> AppleAttester {
    AppleAttester::new(
        ApplePolicy {
            trusted_roots: roots,
            apps: apps.iter().map(|a| a.parse().unwrap()).collect(),
            allow_development: development,
        },
        registry(dir),
    )
    .unwrap()
}

fn test_attester(apple: &TestApple, dir: &std::path::Path) -> AppleAttester {
    let roots = root_certificates_from_pem(apple.root_pem.as_bytes()).unwrap();
    attester(roots, &[APP_ID], false, dir)
}

fn checks<T: std::fmt::Debug>(
    result: Result<T, Vec<confed_issuer::attester::FailedCheck>>,
) -> Vec<&'static str> {
    result.unwrap_err().iter().map(|f| f.check).collect()
}

fn sample_field(path: &[&str]) -> String {
    let json: serde_json::Value = serde_json::from_str(SAMPLE).unwrap();
    let mut value = &json;
    for key in path {
        value = &value[key];
    }
    value.as_str().unwrap().to_string()
}

fn sample(path: &[&str]) -> Vec<u8> {
    STANDARD.decode(sample_field(path)).unwrap()
}

#[test]
fn a_real_ios_attestation_verifies_under_apples_root_and_its_assertion_under_the_attested_key() {
    let dir = tempfile::tempdir().unwrap();
    let apple = attester(apple_roots(), &[SAMPLE_APP], true, dir.path());
    let key_id = sample(&["attestation", "keyIdBase64"]);
    let object = sample(&["attestation", "attestationBase64"]);
    let client_data_hash: [u8; 32] = sample(&["attestation", "clientDataHashSha256Base64"])
        .try_into()
        .unwrap();
    let attested = apple
        .verify_attestation(&key_id, &object, &client_data_hash, SAMPLE_TIME)
        .unwrap();
    assert!(attested.development);
    let registered = Registered {
        development: attested.development,
        rp_id_hash: attested.rp_id_hash,
        public_key: attested.public_key,
        counter: 0,
    };
    let assertion = sample(&["assertion", "assertionBase64"]);
    assert_eq!(
        apple.verify_assertion(&registered, &assertion, &client_data_hash),
        Ok(1)
    );
    // The same assertion again (its counter not above the recorded one) is a replay.
    let after = Registered {
        counter: 1,
        ..registered.clone()
    };

    assert_eq!(
        checks(apple.verify_assertion(&after, &assertion, &client_data_hash)),
        ["counter"]
    );
    // Over another challenge the signature does not verify.
    assert_eq!(
        checks(apple.verify_assertion(&registered, &assertion, &[0; 32])),
        ["signature"]
    );
    // After its credential certificate expired, for a production-only issuer, for another app,
    // or over another challenge, the attestation is refused by name.
    assert_eq!(
        checks(apple.verify_attestation(
            &key_id,
            &object,
            &client_data_hash,
            Seconds(SAMPLE_TIME.0 + 2 * 86_400)
        )),
        ["validity"]
    );
    let production = attester(apple_roots(), &[SAMPLE_APP], false, dir.path());
    assert_eq!(
        checks(production.verify_attestation(&key_id, &object, &client_data_hash, SAMPLE_TIME)),
        ["aaguid"]
    );
    let other_app = attester(
        apple_roots(),
        &["A1B2C3D4E5.com.example.fl"],
        true,
        dir.path(),
    );
    assert_eq!(
        checks(other_app.verify_attestation(&key_id, &object, &client_data_hash, SAMPLE_TIME)),
        ["rp_id"]
    );
    assert_eq!(
        checks(apple.verify_attestation(&key_id, &object, &[1; 32], SAMPLE_TIME)),
        ["nonce"]
    );
    // Under a root that is not Apple's, nothing else is looked at.
    let foreign = root_certificates_from_pem(TestApple::new().root_pem.as_bytes()).unwrap();
    let foreign = attester(foreign, &[SAMPLE_APP], true, dir.path());
    assert_eq!(
        checks(foreign.verify_attestation(&key_id, &object, &client_data_hash, SAMPLE_TIME)),
        ["root"]
    );
}

#[test]
fn a_genuine_generated_key_attests_then_asserts_as_one_identity_and_another_key_is_another() {
    let dir = tempfile::tempdir().unwrap();
    let apple = TestApple::new();
    let attester = test_attester(&apple, dir.path());
    let device = TestDevice::new();
    let object = apple.attestation(
        &device,
        &app_attest_client_data_hash(b"c1"),
        &AttestationSpec::genuine(),
    );
    let identity = attester
        .attest(&attestation_evidence(&device.key_id, &object), b"c1", NOW)
        .unwrap();
    for (challenge, counter) in [(&b"c2"[..], 1), (b"c3", 5)] {
        let assertion = device.assertion(&app_attest_client_data_hash(challenge), APP_ID, counter);
        assert_eq!(
            attester
                .attest(
                    &assertion_evidence(&device.key_id, &assertion),
                    challenge,
                    NOW
                )
                .unwrap(),
            identity
        );
    }
    // The same key attested again (a lost answer) is still the same device, and keeps the
    // counter its assertions reached: an assertion at 5 is now a replay.
    let again = apple.attestation(
        &device,
        &app_attest_client_data_hash(b"c4"),
        &AttestationSpec::genuine(),
    );
    assert_eq!(
        attester
            .attest(&attestation_evidence(&device.key_id, &again), b"c4", NOW)
            .unwrap(),
        identity
    );
    let replayed = device.assertion(&app_attest_client_data_hash(b"c5"), APP_ID, 5);
    assert_eq!(
        refused_checks(attester.attest(&assertion_evidence(&device.key_id, &replayed), b"c5", NOW)),
        ["counter"]
    );
    // The registry survives a restart.
    let restarted = test_attester(&apple, dir.path());
    let next = device.assertion(&app_attest_client_data_hash(b"c6"), APP_ID, 6);
    assert_eq!(
        restarted
            .attest(&assertion_evidence(&device.key_id, &next), b"c6", NOW)
            .unwrap(),
        identity
    );
    let other = TestDevice::new();
    let object = apple.attestation(
        &other,
        &app_attest_client_data_hash(b"c7"),
        &AttestationSpec::genuine(),
    );
    assert_ne!(
        attester
            .attest(&attestation_evidence(&other.key_id, &object), b"c7", NOW)
            .unwrap(),
        identity
    );
}

#[test]
fn every_attestation_check_refuses_evidence_that_differs_in_its_field_alone() {
    let dir = tempfile::tempdir().unwrap();
    let apple = TestApple::new();
    let attester = test_attester(&apple, dir.path());
    let device = TestDevice::new();
    let hash = app_attest_client_data_hash(b"c");
    let genuine = AttestationSpec::genuine;
    let cases: Vec<(&str, AttestationSpec)> = vec![
        (
            "fmt",
            AttestationSpec {
                fmt: "packed".into(),
                ..genuine()
            },
        ),
        (
            "certificate_chain",
            AttestationSpec {
                without_intermediate: true,
                ..genuine()
            },
        ),
        (
            "validity",
            AttestationSpec {
                credential_valid: ((2026, 5, 1), (2026, 5, 4)),
                ..genuine()
            },
        ),
        (
            "authenticator_data",
            AttestationSpec {
                truncated: true,
                ..genuine()
            },
        ),
        (
            "nonce",
            AttestationSpec {
                nonce: Some([9; 32]),
                ..genuine()
            },
        ),
        (
            "nonce",
            AttestationSpec {
                nonce_extensions: 0,
                ..genuine()
            },
        ),
        (
            "nonce",
            AttestationSpec {
                nonce_extensions: 2,
                ..genuine()
            },
        ),
        (
            "rp_id",
            AttestationSpec {
                app_id: "A1B2C3D4E5.com.example.other".into(),
                ..genuine()
            },
        ),
        (
            "counter",
            AttestationSpec {
                counter: 1,
                ..genuine()
            },
        ),
        (
            "aaguid",
            AttestationSpec {
                aaguid: *b"appattestdevelop",
                ..genuine()
            },
        ),
        (
            "aaguid",
            AttestationSpec {
                aaguid: [0; 16],
                ..genuine()
            },
        ),
        (
            "credential_id",
            AttestationSpec {
                credential_id: Some(vec![7; 32]),
                ..genuine()
            },
        ),
    ];
    for (check, spec) in cases {
        let object = apple.attestation(&device, &hash, &spec);
        assert_eq!(
            refused_checks(attester.attest(
                &attestation_evidence(&device.key_id, &object),
                b"c",
                NOW
            )),
            [check],
            "{spec:?}"
        );
    }
    // Apple's map after the COSE key is optional.
    let without_map = AttestationSpec {
        trailing_map: false,
        ..genuine()
    };
    let object = apple.attestation(&device, &hash, &without_map);
    attester
        .attest(&attestation_evidence(&device.key_id, &object), b"c", NOW)
        .unwrap();
    let object = apple.attestation(&device, &hash, &genuine());
    // Another key id than the attested key's, over another challenge, or under another root.
    assert_eq!(
        refused_checks(attester.attest(&attestation_evidence(&[1; 32], &object), b"c", NOW)),
        ["key_id", "credential_id"]
    );
    assert_eq!(
        refused_checks(attester.attest(
            &attestation_evidence(&device.key_id, &object),
            b"other",
            NOW
        )),
        ["nonce"]
    );
    let foreign = TestApple::new().attestation(&device, &hash, &genuine());
    assert_eq!(
        refused_checks(attester.attest(&attestation_evidence(&device.key_id, &foreign), b"c", NOW)),
        ["chain_signatures"],
        "a chain whose issuer names match the trusted root's but whose signatures do not"
    );
    // Malformed evidence names what is malformed.
    let both = Evidence::AppleAppAttest {
        key_id: URL_SAFE_NO_PAD.encode(device.key_id),
        attestation: Some(URL_SAFE_NO_PAD.encode(&object)),
        assertion: Some("AA".into()),
    };
    let neither = Evidence::AppleAppAttest {
        key_id: URL_SAFE_NO_PAD.encode(device.key_id),
        attestation: None,
        assertion: None,
    };
    let short_id = attestation_evidence(&[1; 16], &object);
    let not_cbor = attestation_evidence(&device.key_id, b"\xff\xff");
    let too_big = Evidence::AppleAppAttest {
        key_id: URL_SAFE_NO_PAD.encode(device.key_id),
        attestation: Some("A".repeat(40_000)),
        assertion: None,
    };
    for (evidence, check) in [
        (both, "evidence"),
        (neither, "evidence"),
        (short_id, "evidence"),
        (not_cbor, "attestation_object"),
        (too_big, "attestation_object"),
    ] {
        assert_eq!(
            refused_checks(attester.attest(&evidence, b"c", NOW)),
            [check]
        );
    }
    let dev = Evidence::dev(
        &p256::ecdsa::SigningKey::from_slice(&[1; 32]).unwrap(),
        b"c",
    );
    assert_eq!(refused_checks(attester.attest(&dev, b"c", NOW)), ["format"]);
}

#[test]
fn every_assertion_check_refuses_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let apple = TestApple::new();
    let attester = test_attester(&apple, dir.path());
    let device = TestDevice::new();
    let hash = app_attest_client_data_hash(b"c");
    let assert_with = |challenge: &[u8], app: &str, counter: u32| {
        let assertion = device.assertion(&app_attest_client_data_hash(challenge), app, counter);
        refused_checks(attester.attest(&assertion_evidence(&device.key_id, &assertion), b"c", NOW))
    };
    assert_eq!(assert_with(b"c", APP_ID, 1), ["key_id"], "never attested");
    let object = apple.attestation(&device, &hash, &AttestationSpec::genuine());
    attester
        .attest(&attestation_evidence(&device.key_id, &object), b"c", NOW)
        .unwrap();
    assert_eq!(assert_with(b"other", APP_ID, 1), ["signature"]);
    assert_eq!(
        assert_with(b"c", "A1B2C3D4E5.com.example.other", 1),
        ["rp_id"]
    );
    assert_eq!(assert_with(b"c", APP_ID, 0), ["counter"]);
    let garbage = assertion_evidence(&device.key_id, b"\xa1\x61x\x01");
    assert_eq!(
        refused_checks(attester.attest(&garbage, b"c", NOW)),
        ["assertion"]
    );
    // Another key's assertion under this key id does not verify.
    let stranger = TestDevice::new().assertion(&hash, APP_ID, 1);
    assert_eq!(
        refused_checks(attester.attest(&assertion_evidence(&device.key_id, &stranger), b"c", NOW)),
        ["signature"]
    );

    // A development key keeps asserting while development builds are allowed, and stops when
    // they no longer are.
    let development = |allowed: bool| {
        let roots = root_certificates_from_pem(apple.root_pem.as_bytes()).unwrap();
        attester_with(roots, allowed, dir.path())
    };
    let dev_device = TestDevice::new();
    let spec = AttestationSpec {
        aaguid: *b"appattestdevelop",
        ..AttestationSpec::genuine()
    };
    let object = apple.attestation(&dev_device, &hash, &spec);
    development(true)
        .attest(
            &attestation_evidence(&dev_device.key_id, &object),
            b"c",
            NOW,
        )
        .unwrap();
    let assertion = dev_device.assertion(&hash, APP_ID, 1);
    let evidence = assertion_evidence(&dev_device.key_id, &assertion);
    assert_eq!(
        refused_checks(development(false).attest(&evidence, b"c", NOW)),
        ["aaguid"]
    );
    development(true).attest(&evidence, b"c", NOW).unwrap();
}

fn attester_with(roots: Vec<Vec<u8>>, development: bool, dir: &std::path::Path) -> AppleAttester {
    attester(roots, &[APP_ID], development, dir)
}

#[test]
fn app_ids_parse_as_team_and_bundle_and_bad_ones_say_what_to_write() {
    let app: AllowedAppId = SAMPLE_APP.parse().unwrap();
    assert_eq!(app.app_id, SAMPLE_APP);
    for bad in [
        "com.example.app",
        "abcde12345.com.example",
        "A1B2C3D4E5.",
        "A1B2C3D4E5.a b",
    ] {
        let error = bad.parse::<AllowedAppId>().unwrap_err().to_string();
        assert!(error.contains("TEAMID.BUNDLEID"), "{error}");
    }
    let dir = tempfile::tempdir().unwrap();
    // A root that would fail every attestation fails the start instead.
    let mut trailing = apple_roots();
    trailing[0].push(0);
    for roots in [vec![], vec![b"junk".to_vec()], trailing] {
        assert!(
            AppleAttester::new(
                ApplePolicy {
                    trusted_roots: roots,
                    apps: vec![SAMPLE_APP.parse().unwrap()],
                    allow_development: false
                },
                registry(dir.path()),
            )
            .is_err()
        );
    }
    assert!(
        AppleAttester::new(
            ApplePolicy {
                trusted_roots: apple_roots(),
                apps: vec![],
                allow_development: false
            },
            registry(dir.path()),
        )
        .is_err()
    );
}

#[tokio::test]
async fn an_ios_device_gets_l_tokens_and_the_same_key_attested_again_or_asserting_gets_no_more() {
    const L: u32 = 2;
    let signer = TokenSigner::generate().unwrap();
    let client = TokenClient::from_spki(signer.spki()).unwrap();
    let apple = TestApple::new();
    let state = tempfile::tempdir().unwrap();
    // Beside an Android attester, as for an app on both platforms.
    let android = confed_issuer::attester::android::AndroidAttester::new(
        confed_issuer::attester::android::AndroidPolicy {
            trusted_roots: confed_issuer::attester::android::google_root_keys(),
            apps: vec![
                format!("com.example.fl:{}", "5a".repeat(32))
                    .parse()
                    .unwrap(),
            ],
            status_list: Default::default(),
            min_os_patch_level: None,
        },
    )
    .unwrap();
    let both = Attesters::new(vec![
        Box::new(android),
        Box::new(test_attester(&apple, state.path())),
    ])
    .unwrap();
    assert_eq!(
        both.formats(),
        ["android-key-attestation", "apple-app-attest"]
    );
    let issuer = Issuer::new(
        "issuer.test".into(),
        signer,
        Box::new(both),
        Limiter::open(state.path(), L, 86_400).unwrap(),
        86_400,
        Arc::new(ManualClock::starting_at(NOW.millis())),
    )
    .unwrap();
    let app = routes::router(Arc::new(issuer));
    let ask = |challenge: &[u8], evidence: Evidence, tokens: usize| {
        serde_json::to_string(&TokenRequestBody {
            challenge: Some(URL_SAFE_NO_PAD.encode(challenge)),
            evidence: Some(evidence),
            credential: None,
            token_requests: (0..tokens)
                .map(|_| URL_SAFE_NO_PAD.encode(client.begin(b"round").unwrap().0.encode()))
                .collect(),
        })
        .unwrap()
    };
    let device = TestDevice::new();
    let attest = |challenge: &[u8], device: &TestDevice| {
        let object = apple.attestation(
            device,
            &app_attest_client_data_hash(challenge),
            &AttestationSpec::genuine(),
        );
        attestation_evidence(&device.key_id, &object)
    };

    let c = challenge(&app).await;
    let (status, body) = token_request(&app, ask(&c, attest(&c, &device), 2)).await;
    assert_eq!(status, StatusCode::OK, "{}", String::from_utf8_lossy(&body));
    let answer: TokenResponseBody = serde_json::from_slice(&body).unwrap();
    assert_eq!((answer.token_responses.len(), answer.remaining), (2, 0));

    // The same key attested again, or asserting, draws on the same allowance.
    let c = challenge(&app).await;
    let (status, _) = token_request(&app, ask(&c, attest(&c, &device), 1)).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    let c = challenge(&app).await;
    let assertion = device.assertion(&app_attest_client_data_hash(&c), APP_ID, 1);
    let (status, _) = token_request(
        &app,
        ask(&c, assertion_evidence(&device.key_id, &assertion), 1),
    )
    .await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
    // A second key is a second allowance (what L bounds on iOS: docs/threat-model.md).
    let c = challenge(&app).await;
    let (status, _) = token_request(&app, ask(&c, attest(&c, &TestDevice::new()), 1)).await;
    assert_eq!(status, StatusCode::OK);

    // A refusal names its check, as problem+json; Android evidence goes to the Android attester.
    let c = challenge(&app).await;
    let replay = device.assertion(&app_attest_client_data_hash(&c), APP_ID, 1);
    let (status, problem) = token_request(
        &app,
        ask(&c, assertion_evidence(&device.key_id, &replay), 1),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let problem: serde_json::Value = serde_json::from_slice(&problem).unwrap();
    assert_eq!(problem["failed_checks"][0]["check"], "counter", "{problem}");
    let c = challenge(&app).await;
    let android = Evidence::AndroidKeyAttestation {
        certificate_chain: vec!["AA".into()],
    };
    let (status, problem) = token_request(&app, ask(&c, android, 1)).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let problem: serde_json::Value = serde_json::from_slice(&problem).unwrap();
    assert_eq!(
        problem["failed_checks"][0]["check"], "certificate_chain",
        "{problem}"
    );
    let (_, _, directory) = call(&app, "GET", "/v1/directory", None).await;
    let directory: serde_json::Value = serde_json::from_slice(&directory).unwrap();
    assert_eq!(
        directory["attesters"],
        serde_json::json!(["android-key-attestation", "apple-app-attest"])
    );
}
