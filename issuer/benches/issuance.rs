#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Token issuance per second on one core (`cargo bench -p confed-issuer --bench issuance`):
//! the blind signature alone (the pure-Rust reference and AWS-LC, which the issuer uses); whole requests through `Issuer::issue` (credential
//! checked, grant appended and synced to a file under `target/`, tokens signed) with 1 and 16
//! tokens a request; and the device's half (blind, then unblind and verify). The issue's goal is
//! 500 issuances a second a core; verification by an origin is in `benches/key_release.rs`.
//! Last, Android key attestations checked per second (real Pixel chains under each Google root),
//! the cost a device pays once per window.

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
