//! Token issuance per second on one core (`cargo bench -p confed-issuer --bench issuance`):
//! the blind signature alone (the pure-Rust reference and AWS-LC, which the issuer uses); whole requests through `Issuer::issue` (credential
//! checked, grant appended and synced to a file under `target/`, tokens signed) with 1 and 16
//! tokens a request; and the device's half (blind, then unblind and verify). The issue's goal is
//! 500 issuances a second a core; verification by an origin is in `benches/key_release.rs`.

use std::sync::Arc;
use std::time::Instant;

use confed_issuer::attester::dev::DevAttester;
use confed_issuer::limiter::Limiter;
use confed_issuer::{IssueRequest, Issuer, Proof};
use confed_protocol::clock::SystemClock;
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
}
