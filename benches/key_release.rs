#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Key release figures (run with `cargo bench --bench key_release`): appraisal throughput of the
//! production (RS256) and dev (ES256) policies, Shamir split/combine, the whole enclave key
//! collection against in-process key services over loopback HTTP (a new release commitment per
//! collection, recorded in each ledger and fsync'd before the answer), the ledger's bytes per
//! round, the time to verify a release's proof offline, and a refusal flood against one key
//! service (`support/refusal_flood.rs`).

#[path = "support/refusal_flood.rs"]
mod refusal_flood;

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed::clock::{ManualClock, Millis};
use confed::keys::ShareFile;
use confed::keys::ceremony::{CeremonyOptions, generate};
use confed::keyservice::{KeyService, KeyServiceParts, routes};
use confed_attestation::claims::TokenClaims;
use confed_attestation::dev::DevAttester;
use confed_attestation::jwk::{Jwk, Jwks};
use confed_attestation::{AppraisalPolicy, Expectations, KeySource, appraise, jws};
use confed_enclave::key_collection::{KeyRequest, KeyServiceEndpoint, obtain_private_key};
use confed_protocol::hpke;
use ring::signature::{RSA_PKCS1_SHA256, RsaKeyPair, RsaPublicKeyComponents};

const NOW: i64 = 1_800_000_000;

fn per_second(count: usize, elapsed: Duration) -> f64 {
    count as f64 / elapsed.as_secs_f64()
}

fn appraisal_rs256() {
    let der = std::fs::read("attestation/testdata/test-root-rsa.der").unwrap();
    let key = RsaKeyPair::from_der(&der).unwrap();
    let public: RsaPublicKeyComponents<Vec<u8>> = key.public().into();
    let jwk = Jwk::Rsa {
        kid: "k".into(),
        n: public.n,
        e: public.e,
    };
    let mut policy = AppraisalPolicy::load(Path::new("policies/confidential-space.toml")).unwrap();
    let digest = format!("sha256:{}", "1".repeat(64));
    policy.workload.image_digests = vec![digest.clone()];
    let mut claims = TokenClaims::confidential_space(
        "https://confidentialcomputing.googleapis.com",
        "aud",
        vec!["n".repeat(43), "b".repeat(64)],
        NOW,
    );
    claims.image_digest = Some(digest);
    let token = jws::encode(
        &serde_json::json!({"alg": "RS256", "kid": "k"}),
        &claims.to_json(),
        |m| {
            let mut sig = vec![0; key.public().modulus_len()];
            key.sign(
                &RSA_PKCS1_SHA256,
                &ring::rand::SystemRandom::new(),
                m,
                &mut sig,
            )
            .unwrap();
            sig
        },
    );
    let binding = "b".repeat(64);
    let nonce = "n".repeat(43);
    let expect = Expectations {
        audience: "aud",
        nonce: &nonce,
        key_binding: &binding,
        now_unix: NOW,
    };
    let n = 5000;
    let started = Instant::now();
    for _ in 0..n {
        let parsed = jws::parse(&token).unwrap();
        assert!(
            appraise(&token, &parsed, Some(&jwk), &policy, &expect)
                .report
                .passed()
        );
    }
    println!(
        "appraisal, production policy (RS256-2048):   {:>9.0} tokens/s",
        per_second(n, started.elapsed())
    );
}

fn appraisal_es256() {
    let attester = DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        Arc::new(|| NOW),
    );
    let policy = AppraisalPolicy::load(Path::new("policies/dev.toml")).unwrap();
    let request = confed_attestation::TokenRequest {
        audience: "aud".into(),
        nonces: vec!["n".repeat(43), "b".repeat(64)],
    };
    let token = attester.sign(&attester.claims_for(&request));
    let jwks: Jwks = attester.jwks();
    let key = jwks.get(confed_attestation::dev::DEV_KID).unwrap().clone();
    let binding = "b".repeat(64);
    let nonce = "n".repeat(43);
    let expect = Expectations {
        audience: "aud",
        nonce: &nonce,
        key_binding: &binding,
        now_unix: NOW,
    };
    let n = 2000;
    let started = Instant::now();
    for _ in 0..n {
        let parsed = jws::parse(&token).unwrap();
        assert!(
            appraise(&token, &parsed, Some(&key), &policy, &expect)
                .report
                .passed()
        );
    }
    println!(
        "appraisal, dev policy (ES256):               {:>9.0} tokens/s",
        per_second(n, started.elapsed())
    );
}

fn shamir() {
    let secret = [42u8; 32];
    let n = 20_000;
    let started = Instant::now();
    for _ in 0..n {
        let shares = confed_protocol::shares::split(&secret, 3, 5).unwrap();
        let picked: Vec<&[u8]> = shares[..3].iter().map(|s| s.as_slice()).collect();
        assert_eq!(
            confed_protocol::shares::combine(3, &picked)
                .unwrap()
                .as_slice(),
            &secret
        );
    }
    println!(
        "shamir 3-of-5 split + combine (32 B):        {:>9.0} /s",
        per_second(n, started.elapsed())
    );
}

async fn collection() {
    let dir = tempfile::tempdir().unwrap();
    let outcome = generate(&CeremonyOptions {
        shares: 5,
        threshold: 3,
        out_dir: dir.path().join("c"),
        not_before: NOW - 10,
        not_after: NOW + 86_400,
    })
    .unwrap();
    let clock = Arc::new(ManualClock::starting_at(Millis(NOW * 1000)));
    let attester = DevAttester::new(
        confed_attestation::exchange::generate_signing_key(),
        Arc::new(|| NOW),
    );
    let mut endpoints = Vec::new();
    let mut verifying_keys = Vec::new();
    for (i, path) in outcome.share_files.iter().enumerate() {
        let signing = confed_attestation::exchange::generate_signing_key();
        verifying_keys.push((format!("ks{}", i + 1), *signing.verifying_key()));
        let service = KeyService::new(KeyServiceParts {
            id: format!("ks{}", i + 1),
            audience: format!("confed-keyservice/ks{}", i + 1),
            signing_key: signing,
            shares: vec![ShareFile::load(path).unwrap()],
            policy: AppraisalPolicy::load(Path::new("policies/dev.toml")).unwrap(),
            key_source: KeySource::fixed(attester.jwks()),
            audit_log: dir.path().join(format!("audit-{i}.jsonl")),
            clock: clock.clone(),
        })
        .unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        endpoints.push(KeyServiceEndpoint {
            id: service.id.clone(),
            url: format!("http://{}", listener.local_addr().unwrap()),
        });
        tokio::spawn(async move {
            axum::serve(listener, routes::router(service))
                .await
                .unwrap()
        });
    }
    let public =
        hpke::PublicKey::from_bytes(&URL_SAFE_NO_PAD.decode(&outcome.key.public_key).unwrap())
            .unwrap();
    let n = 200;
    let policy = confed_protocol::policy::TaskPolicy::sample("t", n as u32);
    let request = |round: u64| KeyRequest {
        key_id: outcome.key.key_id.clone(),
        public_key: public,
        threshold: 3,
        task_id: "t".into(),
        round,
        commitment: confed_attestation::release::ReleaseCommitment {
            task_id: "t".into(),
            round,
            key_id: outcome.key.key_id.clone(),
            policy_sha256: policy.sha256_hex(),
            model_sha256: "0".repeat(64),
            inputs_digest: "1".repeat(64),
        },
        policy: policy.encode(),
    };
    let signing_key = confed_attestation::exchange::generate_signing_key();
    let client = confed_protocol::http::client(Duration::from_secs(10));
    let mut latencies = Vec::with_capacity(n);
    let mut last = None;
    for round in 1..=n as u64 {
        let started = Instant::now();
        let obtained = obtain_private_key(
            &client,
            &endpoints,
            &request(round),
            &attester,
            &signing_key,
            Duration::from_secs(10),
        )
        .await
        .unwrap();
        latencies.push(started.elapsed());
        last = Some((request(round).commitment, obtained.receipts));
    }
    latencies.sort();
    println!(
        "key collection 3-of-5 over loopback HTTP, a new commitment each (quorum 4 recorded, ledger fsync'd): p50 {:.2} ms, p99 {:.2} ms",
        latencies[n / 2].as_secs_f64() * 1e3,
        latencies[n * 99 / 100].as_secs_f64() * 1e3
    );
    let log = dir.path().join("audit-0.jsonl");
    let bytes = std::fs::metadata(&log).unwrap().len();
    println!(
        "ledger: {:.0} bytes per round per key service (one signed audit record carrying the commitment; {n} rounds, {bytes} bytes)",
        bytes as f64 / n as f64
    );
    // Verifying a release offline: the enclave's signature and the receipts.
    let (commitment, receipts) = last.unwrap();
    let text = confed_attestation::release::release_text(&commitment, "m", "a");
    let proof = confed_attestation::release::ReleaseProof {
        enclave: confed_attestation::release::ReleaseSignature {
            enclave_signing_key: confed_attestation::exchange::encode_verifying_key(
                signing_key.verifying_key(),
            ),
            signature: confed_attestation::release::sign_text(&signing_key, &text),
        },
        commitment: commitment.clone(),
        receipts,
    };
    let keys: Vec<(String, p256::ecdsa::VerifyingKey)> = verifying_keys
        .iter()
        .map(|(id, key)| (id.clone(), *key))
        .collect();
    let trusted: Vec<confed_attestation::release::TrustedSigner<'_>> = keys
        .iter()
        .map(|(id, key)| confed_attestation::release::TrustedSigner {
            id,
            verifying_key: key,
        })
        .collect();
    let rounds = 200;
    let started = Instant::now();
    for _ in 0..rounds {
        let check = proof.check(
            &commitment,
            "m",
            "a",
            &trusted,
            confed_attestation::release::KeySetShape::new(3, 5),
        );
        assert!(check.failures.is_empty(), "{:?}", check.lines);
    }
    println!(
        "release proof verification (enclave signature + {} receipts): {:.2} ms each",
        proof.receipts.len(),
        started.elapsed().as_secs_f64() * 1e3 / f64::from(rounds)
    );
}

/// An origin's check of a device token (Privacy Pass type 0x0002, issue 29): the challenge
/// digest, the key id and the RSASSA-PSS-SHA384 authenticator, on one core.
fn token_verification() {
    use confed_protocol::privacy_pass::{IssuerKey, Token};
    let cases: Vec<std::collections::BTreeMap<String, String>> = serde_json::from_str(
        &std::fs::read_to_string("protocol/testdata/privacy_pass_type2_vectors.json").unwrap(),
    )
    .unwrap();
    let hex = |k: &str| confed_protocol::hex::decode(&cases[0][k]).unwrap();
    let key = IssuerKey::from_spki(&hex("pkS")).unwrap();
    let (challenge, token) = (hex("token_challenge"), hex("token"));
    let n = 20_000;
    let started = Instant::now();
    for _ in 0..n {
        let token = Token::decode(&token).unwrap();
        key.verify(&token, &challenge).unwrap();
    }
    println!(
        "device token (Privacy Pass type 2, RSA-2048 PSS-SHA384) decode + verify: {:.0} /s on one core",
        per_second(n, started.elapsed())
    );
}

fn main() {
    confed_protocol::http::install_crypto_provider();
    token_verification();
    appraisal_rs256();
    appraisal_es256();
    shamir();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(collection());
    // 65 s: the refusal budget is per minute, so a run crosses a minute's boundary.
    let seconds = std::env::var("CONFED_FLOOD_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(65);
    runtime.block_on(refusal_flood::refusal_flood(seconds));
}
