#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Token issuance per second on one core (`cargo bench -p confed-issuer --bench issuance`):
//! the blind signature alone (the pure-Rust reference and AWS-LC, which the issuer uses); whole requests through `Issuer::issue` (credential
//! checked, grant appended and synced to a file under `target/`, tokens signed) with 1 and 16
//! tokens a request; and the device's half (blind, then unblind and verify). The issue's goal is
//! 500 issuances a second a core; verification by an origin is in `benches/key_release.rs`.
//! Last, Android key attestations checked per second (real Pixel chains under each Google root),
//! the cost a device pays once per window, and Apple App Attest: the recorded iOS attestation and
//! assertion checked, and a whole assertion through the attester (its key record replaced and
//! synced under `target/`), what an iOS device costs once per window after its first.

use std::sync::Arc;
use std::time::Instant;

use confed_issuer::attester::dev::DevAttester;
use confed_issuer::limiter::Limiter;
use confed_issuer::{IssueRequest, Issuer, Proof};
use confed_protocol::clock::{Seconds, SystemClock};
use confed_protocol::privacy_pass::issuance::{TokenClient, TokenSigner};
use confed_protocol::privacy_pass::issuer_api::Evidence;

fn per_second(count: usize, started: Instant) -> f64 {
    count as f64 / started.elapsed().as_secs_f64()
}

fn main() {
    let signer = TokenSigner::generate().unwrap();
    let spki = signer.spki().to_vec();
    let client = TokenClient::from_spki(&spki).unwrap();
    let challenge = b"a token challenge";

    let requests: Vec<_> = (0..1000)
        .map(|_| client.begin(challenge).unwrap())
        .collect();
    let started = Instant::now();
    for (request, _) in &requests {
        signer.sign(request).unwrap();
    }
    println!(
        "blind signature, crypto-bigint (RSA-2048, CRT, blinded, result checked): {:.0}/s on one core",
        per_second(requests.len(), started)
    );
    let fast = confed_issuer::rsa_awslc::AwsLcSigner::from_pkcs8_der(&signer.pkcs8_der().unwrap())
        .unwrap();
    let started = Instant::now();
    for (request, _) in &requests {
        fast.sign(&request.blinded_msg).unwrap();
    }
    println!(
        "blind signature, AWS-LC (RSA-2048, CRT, blinded, result checked): {:.0}/s on one core",
        per_second(requests.len(), started)
    );

    let started = Instant::now();
    let mut pending = Vec::new();
    for _ in 0..1000 {
        pending.push(client.begin(challenge).unwrap());
    }
    let blind = per_second(pending.len(), started);
    let responses: Vec<_> = pending
        .iter()
        .map(|(r, _)| signer.sign(r).unwrap())
        .collect();
    let started = Instant::now();
    for ((_, pending), response) in pending.into_iter().zip(&responses) {
        client.finish(pending, response).unwrap();
    }
    println!(
        "device: blind {blind:.0}/s, unblind and verify {:.0}/s on one core",
        per_second(responses.len(), started)
    );

    // Whole requests, the grant synced to a real file system (target/, not a tmpfs).
    let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let issuer = Issuer::new(
        "bench".into(),
        TokenSigner::from_pem(&signer.to_pem().unwrap()).unwrap(),
        Box::new(DevAttester),
        Limiter::open(state.path(), u32::MAX, 86_400).unwrap(),
        86_400,
        Arc::new(SystemClock),
    )
    .unwrap();
    let device = p256::ecdsa::SigningKey::from_slice(&[7; 32]).unwrap();
    let (c, _) = issuer.challenge().unwrap();
    let first = issuer
        .issue(&IssueRequest {
            proof: Proof::Attested {
                evidence: Evidence::dev(&device, &c),
                challenge: c,
            },
            token_requests: vec![client.begin(challenge).unwrap().0],
        })
        .unwrap();
    for per_request in [1usize, 16] {
        let calls = 1600 / per_request;
        let batches: Vec<Vec<_>> = (0..calls)
            .map(|_| {
                (0..per_request)
                    .map(|_| client.begin(challenge).unwrap().0)
                    .collect()
            })
            .collect();
        let started = Instant::now();
        for token_requests in batches {
            issuer
                .issue(&IssueRequest {
                    proof: Proof::Credential(first.credential.clone()),
                    token_requests,
                })
                .unwrap();
        }
        println!(
            "Issuer::issue, {per_request} token(s) a request (credential, synced grant, signing): {:.0} tokens/s on one core",
            per_second(calls * per_request, started)
        );
    }

    limiter_group_commit();
    android_attestations();
    apple_attestations();
}

/// The limiter alone (HMAC, append, synced to a real file system under `target/`), one thread
/// against many: concurrent grants share a sync (group commit).
fn limiter_group_commit() {
    for threads in [1usize, 4, 16, 64] {
        let state = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
        let limiter = Limiter::open(state.path(), u32::MAX, 86_400).unwrap();
        let per_thread = 3200 / threads;
        let started = Instant::now();
        std::thread::scope(|scope| {
            for t in 0..threads {
                let limiter = &limiter;
                scope.spawn(move || {
                    for i in 0..per_thread {
                        let mut device = [0u8; 32];
                        device[..8].copy_from_slice(&(t as u64).to_be_bytes());
                        device[8..16].copy_from_slice(&(i as u64).to_be_bytes());
                        limiter
                            .take(&device, 1, || Seconds(1_000))
                            .unwrap()
                            .unwrap();
                    }
                });
            }
        });
        let grants = threads * per_thread;
        println!(
            "limiter grants, {threads} thread(s): {:.0}/s, {:.2} syncs a grant",
            per_second(grants, started),
            limiter.syncs() as f64 / grants as f64
        );
    }
}

fn android_attestations() {
    use confed_issuer::attester::Attester;
    use confed_issuer::attester::android::{AndroidAttester, AndroidPolicy, google_root_keys};
    let attester = AndroidAttester::new(AndroidPolicy {
        trusted_roots: google_root_keys(),
        apps: vec![
            "com.google.android.attestation:103938ee4537e59e8ee792f654504fb8346fc6b346d0bbc4415fc339fcfc8ec1"
                .parse()
                .unwrap(),
        ],
        status_list: Default::default(),
        min_os_patch_level: None,
    })
    .unwrap();
    let samples = [
        (
            "EC P-384 root, 5 certificates",
            include_str!("../testdata/android/tegu_sdk36_TEE_EC_2026_ROOT.pem"),
            &b"6417f92c-daef-4cc1-8828-5bb39338ffd5"[..],
            1_772_323_200,
        ),
        (
            "RSA-4096 root, 5 certificates",
            include_str!("../testdata/android/caiman_sdk36_TEE_EC_RKP.pem"),
            &b"d688d763-6118-4ca6-94b2-e6cd9ed7e4e4"[..],
            1_759_190_400,
        ),
    ];
    for (name, pem, challenge, now) in samples {
        let chain: Vec<String> = pem
            .split("-----END CERTIFICATE-----")
            .filter_map(|block| block.split("-----BEGIN CERTIFICATE-----").nth(1))
            .map(|body| {
                use base64::Engine as _;
                let der = base64::engine::general_purpose::STANDARD
                    .decode(body.split_whitespace().collect::<String>())
                    .unwrap();
                base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(der)
            })
            .collect();
        let evidence = Evidence::AndroidKeyAttestation {
            certificate_chain: chain,
        };
        let count = 2000;
        let started = Instant::now();
        for _ in 0..count {
            attester.attest(&evidence, challenge, Seconds(now)).unwrap();
        }
        println!(
            "Android key attestation checked ({name}): {:.0}/s on one core",
            per_second(count, started)
        );
    }
}

#[path = "../tests/support/app_attest.rs"]
#[allow(dead_code, reason = "the benchmark uses part of the tests' generator")]
mod app_attest;

fn apple_attestations() {
    use base64::Engine as _;
    use base64::engine::general_purpose::STANDARD;
    use confed_issuer::attester::Attester;
    use confed_issuer::attester::apple::registry::{Registered, Registry};
    use confed_issuer::attester::apple::{AppleAttester, ApplePolicy, apple_roots};
    use confed_protocol::privacy_pass::issuer_api::app_attest_client_data_hash;

    let sample: serde_json::Value =
        serde_json::from_str(include_str!("../testdata/apple/ios-14.4.json")).unwrap();
    let field = |path: [&str; 2]| {
        STANDARD
            .decode(sample[path[0]][path[1]].as_str().unwrap())
            .unwrap()
    };
    let state = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("bench-app-attest");
    let _ = std::fs::remove_dir_all(&state);
    let registry = |roots: Vec<Vec<u8>>, app: &str| {
        AppleAttester::new(
            ApplePolicy {
                trusted_roots: roots,
                apps: vec![app.parse().unwrap()],
                allow_development: true,
            },
            Registry::open(
                &state,
                ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[1; 32]),
            )
            .unwrap(),
        )
        .unwrap()
    };
    let real = registry(
        apple_roots(),
        "6MURL8TA57.de.vincent-haupert.apple-appattest-poc",
    );
    let key_id = field(["attestation", "keyIdBase64"]);
    let object = field(["attestation", "attestationBase64"]);
    let hash: [u8; 32] = field(["attestation", "clientDataHashSha256Base64"])
        .try_into()
        .unwrap();
    let at = Seconds(1_611_446_400);
    let count = 2000;
    let started = Instant::now();
    for _ in 0..count {
        real.verify_attestation(&key_id, &object, &hash, at)
            .unwrap();
    }
    println!(
        "App Attest attestation checked (recorded iOS 14.4, P-384 root, 2 certificates): {:.0}/s on one core",
        per_second(count, started)
    );
    let attested = real
        .verify_attestation(&key_id, &object, &hash, at)
        .unwrap();
    let registered = Registered {
        development: attested.development,
        rp_id_hash: attested.rp_id_hash,
        public_key: attested.public_key,
        counter: 0,
    };
    let assertion = field(["assertion", "assertionBase64"]);
    let count = 5000;
    let started = Instant::now();
    for _ in 0..count {
        real.verify_assertion(&registered, &assertion, &hash)
            .unwrap();
    }
    println!(
        "App Attest assertion checked (recorded iOS 14.4): {:.0}/s on one core",
        per_second(count, started)
    );

    let apple = app_attest::TestApple::new();
    let roots =
        confed_issuer::attester::apple::root_certificates_from_pem(apple.root_pem.as_bytes())
            .unwrap();
    let attester = registry(roots, app_attest::APP_ID);
    let device = app_attest::TestDevice::new();
    let now = Seconds(1_780_272_000);
    let object = apple.attestation(
        &device,
        &app_attest_client_data_hash(b"c"),
        &app_attest::AttestationSpec::genuine(),
    );
    attester
        .attest(
            &app_attest::attestation_evidence(&device.key_id, &object),
            b"c",
            now,
        )
        .unwrap();
    let count = 500u32;
    let evidence: Vec<_> = (1..=count)
        .map(|counter| {
            let assertion = device.assertion(
                &app_attest_client_data_hash(b"c"),
                app_attest::APP_ID,
                counter,
            );
            app_attest::assertion_evidence(&device.key_id, &assertion)
        })
        .collect();
    let started = Instant::now();
    for evidence in &evidence {
        attester.attest(evidence, b"c", now).unwrap();
    }
    println!(
        "App Attest assertion through the attester (record replaced and synced): {:.0}/s",
        per_second(count as usize, started)
    );
}
