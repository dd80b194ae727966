#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! The key service's attacker-facing parsers on thousands of generated inputs: random bytes,
//! truncations and single-byte mutations of valid inputs. They must return errors, never panic.
//! (The cargo-fuzz targets in `fuzz/` explore the same functions far longer.)

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_attestation::exchange::ReleaseRequest;
use confed_attestation::{AppraisalPolicy, Expectations, appraise, jws};

/// A small deterministic generator (xorshift64*), so failures reproduce.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

fn mutations(seed: &[u8], rng: &mut Rng, count: usize) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for _ in 0..count {
        let mut bytes = seed.to_vec();
        match rng.below(4) {
            0 => bytes.truncate(rng.below(bytes.len() + 1)),
            1 => {
                let i = rng.below(bytes.len());
                bytes[i] = rng.next() as u8;
            }
            2 => {
                let i = rng.below(bytes.len());
                bytes.insert(i, b"{}[].\"\\,:"[rng.below(9)]);
            }
            _ => bytes = (0..rng.below(256)).map(|_| rng.next() as u8).collect(),
        }
        out.push(bytes);
    }
    out
}

fn policy() -> AppraisalPolicy {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../policies/confidential-space.toml"
    );
    AppraisalPolicy::load(std::path::Path::new(path)).unwrap()
}

#[test]
fn token_parser_and_appraisal_never_panic() {
    let claims = confed_attestation::claims::TokenClaims::confidential_space(
        "i",
        "a",
        vec!["n".repeat(20)],
        0,
    );
    let seed = jws::encode(
        &serde_json::json!({"alg": "RS256", "kid": "k"}),
        &claims.to_json(),
        |_| vec![1; 256],
    );
    let policy = policy();
    let expect = Expectations {
        audience: "a",
        nonce: "n",
        key_binding: "b",
        now_unix: 0,
    };
    let mut rng = Rng(0x5eed);
    let mut parsed = 0;
    for bytes in mutations(seed.as_bytes(), &mut rng, 5000) {
        let Ok(text) = String::from_utf8(bytes) else {
            continue;
        };
        if let Ok(token) = jws::parse(&text) {
            parsed += 1;
            let appraisal = appraise(&text, &token, None, &policy, &expect);
            assert!(!appraisal.report.passed());
        }
    }
    // Mutated payload bytes often still decode: the appraisal path was exercised too.
    assert!(parsed > 100, "only {parsed} mutated tokens parsed");
}

#[test]
fn release_request_decoder_never_panics() {
    let seed = serde_json::json!({
        "token": "a.b.c", "ephemeral_public_key": URL_SAFE_NO_PAD.encode([1u8; 32]),
        "nonce": "nonce", "task_id": "task", "round": 1,
    })
    .to_string();
    let mut rng = Rng(0xfeed);
    let accepted = mutations(seed.as_bytes(), &mut rng, 5000)
        .iter()
        .filter(|bytes| ReleaseRequest::decode(bytes).is_ok())
        .count();
    assert!(accepted < 5000);
}
