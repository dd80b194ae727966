#![allow(clippy::unwrap_used, reason = "a panic is a test's failure report")]
//! Appraisal of generated good and bad tokens: the production policy (`policies/
//! confidential-space.toml`) against RS256 tokens from a local test root, and the dev policy
//! against the dev attester. Each refusal is its own named case.

use std::path::Path;
use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_attestation::claims::TokenClaims;
use confed_attestation::dev::{self, DevAttester};
use confed_attestation::jwk::{Jwk, Jwks};
use confed_attestation::{
    Appraisal, AppraisalPolicy, Attester, Expectations, TokenRequest, appraise, jws,
    parse_or_refuse,
};
use ring::signature::{RSA_PKCS1_SHA256, RsaKeyPair, RsaPublicKeyComponents};
use rstest::rstest;

const NOW: i64 = 1_800_000_000;
const AUDIENCE: &str = "https://ks1.confed.example";
const NONCE: &str = "bm9uY2Utb2Ytb25lLWtleS1zZXJ2aWNlLWZvci10ZXN0cw";
const DIGEST: &str = "sha256:1111111111111111111111111111111111111111111111111111111111111111";
const TEST_KID: &str = "test-root-1";

fn key_binding() -> String {
    confed_attestation::sha256_hex(b"ephemeral public key bytes")
}

fn policies_dir() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../policies"))
}

/// The production policy as shipped, with the test image digest allow-listed.
fn production_policy() -> AppraisalPolicy {
    let mut policy =
        AppraisalPolicy::load(&policies_dir().join("confidential-space.toml")).unwrap();
    policy.workload.image_digests = vec![DIGEST.to_string()];
    policy
}

fn dev_policy() -> AppraisalPolicy {
    AppraisalPolicy::load(&policies_dir().join("dev.toml")).unwrap()
}

/// Plays Google's signing key: a public test key from `testdata/`.
struct TestRoot {
    key: RsaKeyPair,
}

impl TestRoot {
    fn load() -> Self {
        let der = std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/testdata/test-root-rsa.der"
        ))
        .unwrap();
        Self {
            key: RsaKeyPair::from_der(&der).unwrap(),
        }
    }

    fn jwks(&self) -> Jwks {
        let public: RsaPublicKeyComponents<Vec<u8>> = self.key.public().into();
        Jwks::new(vec![Jwk::Rsa {
            kid: TEST_KID.into(),
            n: public.n,
            e: public.e,
        }])
    }

    fn sign_with(&self, header: serde_json::Value, claims: &TokenClaims) -> String {
        jws::encode(&header, &claims.to_json(), |message| {
            let mut signature = vec![0; self.key.public().modulus_len()];
            let rng = ring::rand::SystemRandom::new();
            self.key
                .sign(&RSA_PKCS1_SHA256, &rng, message, &mut signature)
                .unwrap();
            signature
        })
    }

    fn sign(&self, claims: &TokenClaims) -> String {
        self.sign_with(
            serde_json::json!({"alg": "RS256", "kid": TEST_KID, "typ": "JWT"}),
            claims,
        )
    }
}

fn good_claims() -> TokenClaims {
    let mut claims = TokenClaims::confidential_space(
        "https://confidentialcomputing.googleapis.com",
        AUDIENCE,
        vec![NONCE.to_string(), key_binding()],
        NOW - 30,
    );
    claims.image_digest = Some(DIGEST.to_string());
    claims
}

fn dev_attester() -> DevAttester {
    DevAttester::new(dev::generate_signing_key(), Arc::new(|| NOW))
}

fn dev_request() -> TokenRequest {
    TokenRequest {
        audience: AUDIENCE.into(),
        nonces: vec![NONCE.into(), key_binding()],
    }
}

fn run(token: &str, policy: &AppraisalPolicy, keys: &Jwks) -> Appraisal {
    let binding = key_binding();
    let expect = Expectations {
        audience: AUDIENCE,
        nonce: NONCE,
        key_binding: &binding,
        now_unix: NOW,
    };
    let jws = match parse_or_refuse(token) {
        Ok(jws) => jws,
        Err(refused) => return refused,
    };
    let key = jws.header.kid.as_deref().and_then(|kid| keys.get(kid));
    appraise(token, &jws, key, policy, &expect)
}

fn failed_checks(appraisal: &Appraisal) -> Vec<String> {
    appraisal
        .report
        .failures()
        .map(|(check, _)| check.to_string())
        .collect()
}

#[test]
fn genuine_token_passes_every_production_check() {
    let root = TestRoot::load();
    let appraisal = run(
        &root.sign(&good_claims()),
        &production_policy(),
        &root.jwks(),
    );
    assert!(appraisal.report.passed(), "{:?}", failed_checks(&appraisal));
    assert_eq!(appraisal.image_digest.as_deref(), Some(DIGEST));
    assert!(appraisal.report.results().len() >= 18);
}

/// The launch policy lets the operator say where things are (server, key services, threshold,
/// the Secret Manager secret holding the worker token) and nothing else; the production policy
/// accepts exactly those overrides.
#[test]
fn genuine_token_with_only_the_allowed_env_overrides_passes() {
    let root = TestRoot::load();
    let mut claims = good_claims();
    claims.env_override = Some(serde_json::json!({
        "CONFED_SERVER": "https://confed.example.org",
        "CONFED_KEYSERVICES": "ks1=https://ks1.example.org,ks2=https://ks2.example.org",
        "CONFED_THRESHOLD": "2",
        "CONFED_WORKER_TOKEN_SECRET": "projects/p/secrets/worker-token/versions/latest",
    }));
    let appraisal = run(&root.sign(&claims), &production_policy(), &root.jwks());
    assert!(appraisal.report.passed(), "{:?}", failed_checks(&appraisal));
}

/// The worker token itself in the launch environment would be copied into every attestation
/// token (and so into every key service's logs): the production policy refuses it.
#[test]
fn a_worker_token_passed_in_the_launch_environment_is_refused() {
    let root = TestRoot::load();
    let mut claims = good_claims();
    claims.env_override = Some(serde_json::json!({"CONFED_WORKER_TOKEN": "opaque"}));
    let appraisal = run(&root.sign(&claims), &production_policy(), &root.jwks());
    assert_eq!(failed_checks(&appraisal), ["env_override"]);
}

/// The production policy file, once an operator allow-lists a digest, must also pin the projects
/// and service accounts: the public image started in someone else's project obtains nothing.
#[test]
fn the_production_policy_with_a_digest_but_no_project_does_not_load() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../policies/confidential-space.toml"
    ))
    .unwrap();
    let digest = format!("image_digests = [\"sha256:{}\"]", "a".repeat(64));
    let only_digest = text.replace("image_digests = []", &digest);
    let error = AppraisalPolicy::from_toml(&only_digest).unwrap_err();
    assert!(error.contains("project_ids"), "{error}");
    let pinned = only_digest
        .replace("project_ids = []", "project_ids = [\"confed-example\"]")
        .replace(
            "service_accounts = []",
            "service_accounts = [\"enclave@confed-example.iam.gserviceaccount.com\"]",
        );
    AppraisalPolicy::from_toml(&pinned).unwrap();
}

/// How a bad token is made.
enum Bad {
    /// Change the claims, sign properly with the test root.
    Claims(fn(&mut TokenClaims)),
    /// Make the token some other way.
    Token(fn(&TestRoot, &TokenClaims) -> String),
}

fn flip_signature_bit(token: &str) -> String {
    let (rest, signature) = token.rsplit_once('.').unwrap();
    let mut signature = URL_SAFE_NO_PAD.decode(signature).unwrap();
    signature[10] ^= 0x01;
    format!("{rest}.{}", URL_SAFE_NO_PAD.encode(signature))
}

fn swap_payload(token: &str, claims: &TokenClaims) -> String {
    let parts: Vec<_> = token.split('.').collect();
    let mut payload = claims.to_json();
    payload["dbgstat"] = serde_json::json!("enabled");
    format!(
        "{}.{}.{}",
        parts[0],
        URL_SAFE_NO_PAD.encode(payload.to_string()),
        parts[2]
    )
}

fn hs256_with_public_key(root: &TestRoot, claims: &TokenClaims) -> String {
    let secret = root.key.public().as_ref().to_vec();
    let header = serde_json::json!({"alg": "HS256", "kid": TEST_KID});
    jws::encode(&header, &claims.to_json(), |message| {
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret);
        ring::hmac::sign(&key, message).as_ref().to_vec()
    })
}

fn dev_token_with(claims: &TokenClaims) -> String {
    let attester = dev_attester();
    let mut dev_claims = attester.claims_for(&dev_request());
    dev_claims.image_digest = claims.image_digest.clone();
    attester.sign(&dev_claims)
}

#[rstest]
#[case::expired_token(Bad::Claims(|c| { c.iat = NOW - 500; c.nbf = NOW - 500; c.exp = NOW - 100 }), "exp")]
#[case::not_yet_valid(Bad::Claims(|c| { c.nbf = NOW + 600; c.iat = NOW }), "nbf")]
#[case::too_old(Bad::Claims(|c| { c.iat = NOW - 7200; c.nbf = NOW - 7200; c.exp = NOW + 3600 }), "iat")]
#[case::issued_in_the_future(Bad::Claims(|c| { c.iat = NOW + 3600; c.nbf = NOW }), "iat")]
#[case::wrong_iss(Bad::Claims(|c| c.iss = "https://evil.example".into()), "iss")]
#[case::wrong_aud(Bad::Claims(|c| c.aud = serde_json::json!("https://other.example")), "aud")]
#[case::audience_of_another_key_service(Bad::Claims(|c| c.aud = serde_json::json!("https://ks2.confed.example")), "aud")]
#[case::several_audiences(Bad::Claims(|c| c.aud = serde_json::json!([AUDIENCE, "https://ks2.confed.example"])), "aud")]
#[case::challenge_nonce_missing(Bad::Claims(|c| c.eat_nonce = vec![key_binding()]), "eat_nonce")]
#[case::nonce_not_bound_to_the_ephemeral_key(Bad::Claims(|c| c.eat_nonce = vec![NONCE.into(), "a".repeat(64)]), "key_binding")]
#[case::debug_image(Bad::Claims(|c| c.dbgstat = "enabled".into()), "dbgstat")]
#[case::missing_stable(Bad::Claims(|c| c.support_attributes = vec!["LATEST".into(), "USABLE".into()]), "support_attributes")]
#[case::wrong_swname(Bad::Claims(|c| c.swname = "GCE".into()), "swname")]
#[case::old_swversion(Bad::Claims(|c| c.swversion = vec!["230100".into()]), "swversion")]
#[case::wrong_image_digest(Bad::Claims(|c| c.image_digest = Some(format!("sha256:{}", "2".repeat(64)))), "image_digest")]
#[case::digest_absent(Bad::Claims(|c| c.image_digest = None), "image_digest")]
#[case::wrong_hwmodel(Bad::Claims(|c| c.hwmodel = "GCP_SHIELDED_VM".into()), "hwmodel")]
#[case::secure_boot_off(Bad::Claims(|c| c.secboot = false), "secboot")]
#[case::cmd_override(Bad::Claims(|c| c.cmd_override = Some(vec!["/bin/sh".into()])), "cmd_override")]
#[case::env_override(Bad::Claims(|c| c.env_override = Some(serde_json::json!({"CONFED_EPSILON": "1000"}))), "env_override")]
#[case::forged_signature(Bad::Token(|root, c| flip_signature_bit(&root.sign(c))), "signature")]
#[case::payload_changed_after_signing(Bad::Token(|root, c| swap_payload(&root.sign(c), c)), "signature")]
#[case::unknown_kid(Bad::Token(|root, c| root.sign_with(serde_json::json!({"alg": "RS256", "kid": "rotated-away"}), c)), "signature")]
#[case::no_kid(Bad::Token(|root, c| root.sign_with(serde_json::json!({"alg": "RS256"}), c)), "signature")]
#[case::alg_none(Bad::Token(|_, c| jws::encode(&serde_json::json!({"alg": "none", "kid": TEST_KID}), &c.to_json(), |_| Vec::new())), "algorithm")]
#[case::hs256_with_the_public_key_as_secret(Bad::Token(hs256_with_public_key), "algorithm")]
#[case::dev_token_against_the_production_policy(Bad::Token(|_, c| dev_token_with(c)), "algorithm")]
#[case::not_a_token(Bad::Token(|_, _| "not.a.token".into()), "token_format")]
fn bad_token_is_refused_by_the_production_policy(#[case] bad: Bad, #[case] expected: &str) {
    let root = TestRoot::load();
    let mut claims = good_claims();
    let token = match bad {
        Bad::Claims(mutate) => {
            mutate(&mut claims);
            root.sign(&claims)
        }
        Bad::Token(make) => make(&root, &claims),
    };
    let appraisal = run(&token, &production_policy(), &root.jwks());
    assert!(!appraisal.report.passed(), "accepted a bad token");
    let failed = failed_checks(&appraisal);
    assert!(
        failed.iter().any(|c| c == expected),
        "expected `{expected}` among failed checks {failed:?}"
    );
}

#[test]
fn dev_token_fails_issuer_and_platform_checks_of_production_even_with_its_key() {
    let attester = dev_attester();
    let token = attester.sign(&attester.claims_for(&dev_request()));
    // Even with the dev key wrongly added to the production key set, issuer and hardware refuse it.
    let appraisal = run(&token, &production_policy(), &attester.jwks());
    let failed = failed_checks(&appraisal);
    for check in ["algorithm", "iss", "hwmodel", "secboot", "image_digest"] {
        assert!(
            failed.iter().any(|c| c == check),
            "{check} not among {failed:?}"
        );
    }
}

#[tokio::test]
async fn dev_attester_token_passes_the_dev_policy() {
    let attester = dev_attester();
    let token = attester.token(&dev_request()).await.unwrap();
    let appraisal = run(&token, &dev_policy(), &attester.jwks());
    assert!(appraisal.report.passed(), "{:?}", failed_checks(&appraisal));
    assert_eq!(appraisal.image_digest, Some(dev::dev_image_digest()));
}

#[test]
fn dev_policy_refuses_a_different_dev_key() {
    let trusted = dev_attester();
    let other = dev_attester();
    let token = other.sign(&other.claims_for(&dev_request()));
    let appraisal = run(&token, &dev_policy(), &trusted.jwks());
    assert_eq!(failed_checks(&appraisal), ["signature"]);
}

#[test]
fn dev_policy_refuses_a_production_token() {
    let root = TestRoot::load();
    let appraisal = run(&root.sign(&good_claims()), &dev_policy(), &root.jwks());
    let failed = failed_checks(&appraisal);
    assert!(
        failed.contains(&"algorithm".into()) && failed.contains(&"iss".into()),
        "{failed:?}"
    );
}

#[test]
fn shipped_production_policy_trusts_no_image_until_the_operator_lists_one() {
    let policy = AppraisalPolicy::load(&policies_dir().join("confidential-space.toml")).unwrap();
    assert!(policy.workload.image_digests.is_empty());
    let root = TestRoot::load();
    let appraisal = run(&root.sign(&good_claims()), &policy, &root.jwks());
    assert_eq!(failed_checks(&appraisal), ["image_digest"]);
}

#[tokio::test]
async fn attester_refuses_malformed_nonces_before_signing() {
    let attester = dev_attester();
    for nonces in [
        vec![],
        vec!["short".to_string()],
        vec!["x".repeat(75)],
        vec!["n".repeat(20); 7],
    ] {
        let request = TokenRequest {
            audience: AUDIENCE.into(),
            nonces,
        };
        assert!(attester.token(&request).await.is_err());
    }
}

/// Signs raw header and payload text with the test root (for tokens `serde_json` cannot build,
/// such as duplicate members).
fn sign_raw(root: &TestRoot, header: &str, payload: &str) -> String {
    let signing_input = format!(
        "{}.{}",
        URL_SAFE_NO_PAD.encode(header),
        URL_SAFE_NO_PAD.encode(payload)
    );
    let mut signature = vec![0; root.key.public().modulus_len()];
    root.key
        .sign(
            &RSA_PKCS1_SHA256,
            &ring::rand::SystemRandom::new(),
            signing_input.as_bytes(),
            &mut signature,
        )
        .unwrap();
    format!("{signing_input}.{}", URL_SAFE_NO_PAD.encode(signature))
}

const HEADER: &str = r#"{"alg":"RS256","kid":"test-root-1","typ":"JWT"}"#;

/// A properly signed token whose claims are the good ones changed by `edit`.
fn signed_with(root: &TestRoot, edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut claims = good_claims().to_json();
    edit(&mut claims);
    sign_raw(root, HEADER, &claims.to_string())
}

fn refusal(appraisal: &Appraisal, check: &str) -> String {
    assert_eq!(failed_checks(appraisal), [check]);
    appraisal
        .report
        .failures()
        .next()
        .map(|(_, reason)| reason.to_string())
        .unwrap()
}

/// `aud: [ours, 123]` passed once: the number was dropped before "exactly one audience" was
/// counted. A claim with a non-string entry is refused whole.
#[test]
fn an_audience_with_a_non_string_entry_is_refused() {
    let root = TestRoot::load();
    let token = signed_with(&root, |c| c["aud"] = serde_json::json!([AUDIENCE, 123]));
    let reason = refusal(&run(&token, &production_policy(), &root.jwks()), "aud");
    assert!(reason.contains("not a string"), "{reason}");
}

/// `aud: 12345` was reported as "missing".
#[test]
fn a_numeric_audience_is_reported_as_what_it_is() {
    let root = TestRoot::load();
    let token = signed_with(&root, |c| c["aud"] = serde_json::json!(12345));
    let reason = refusal(&run(&token, &production_policy(), &root.jwks()), "aud");
    assert!(reason.contains("not a string or an array"), "{reason}");
}

/// `swversion: ["250301", 1]` passed once.
#[test]
fn a_swversion_with_a_non_string_entry_is_refused() {
    let root = TestRoot::load();
    let token = signed_with(&root, |c| c["swversion"] = serde_json::json!(["250301", 1]));
    let reason = refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "swversion",
    );
    assert!(reason.contains("not a string"), "{reason}");
}

/// RFC 7515 4.1.11: a `crit` the verifier does not understand must be refused; it passed once.
#[test]
fn an_unknown_crit_header_is_refused() {
    let root = TestRoot::load();
    let header = r#"{"alg":"RS256","kid":"test-root-1","crit":["exp-policy"],"exp-policy":1}"#;
    let token = sign_raw(&root, header, &good_claims().to_json().to_string());
    let reason = refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "token_format",
    );
    assert!(reason.contains("crit"), "{reason}");
}

/// `"crit": null` read as no `crit` and passed: a header that names `crit` at all is refused.
#[test]
fn a_crit_header_of_null_is_refused() {
    let root = TestRoot::load();
    let header = r#"{"alg":"RS256","kid":"test-root-1","crit":null}"#;
    let token = sign_raw(&root, header, &good_claims().to_json().to_string());
    let reason = refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "token_format",
    );
    assert!(reason.contains("crit"), "{reason}");
}

/// `swversion: ["+250301"]` parsed as 250301 and passed: digits only.
#[rstest]
#[case::plus_sign("+250301")]
#[case::spaces(" 250301")]
#[case::empty("")]
fn a_swversion_that_is_not_only_digits_is_refused(#[case] version: &str) {
    let root = TestRoot::load();
    let token = signed_with(&root, |c| c["swversion"] = serde_json::json!([version]));
    let reason = refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "swversion",
    );
    assert!(reason.contains("not a number"), "{reason}");
}

/// A token over 16 KiB is a malformed token (403 `token_format`), not a malformed request.
#[test]
fn a_token_over_the_size_limit_fails_token_format() {
    let root = TestRoot::load();
    let token = format!("{}.{}", signed_with(&root, |_| {}), "A".repeat(20 * 1024));
    let reason = refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "token_format",
    );
    assert!(reason.contains("larger than"), "{reason}");
}

/// Duplicate members were last-wins: `"aud": "theirs", "aud": "ours"` read as ours here and as
/// theirs to a first-wins parser. Refused in the claims and in the header.
#[test]
fn duplicate_json_members_are_refused() {
    let root = TestRoot::load();
    let claims = good_claims().to_json().to_string();
    let payload = claims.replacen('{', r#"{"aud":"someone-else","#, 1);
    let token = sign_raw(&root, HEADER, &payload);
    let reason = refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "token_format",
    );
    assert!(reason.contains("twice"), "{reason}");
    let header = r#"{"alg":"RS256","kid":"other","kid":"test-root-1"}"#;
    let token = sign_raw(&root, header, &claims);
    refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "token_format",
    );
}

/// `exp`/`iat` arithmetic used to wrap (and panic in debug builds) near the ends of i64.
#[test]
fn extreme_times_are_refused_without_wrapping() {
    let root = TestRoot::load();
    let token = signed_with(&root, |c| c["exp"] = serde_json::json!(i64::MAX));
    let reason = refusal(&run(&token, &production_policy(), &root.jwks()), "exp");
    assert!(reason.contains("out of range"), "{reason}");
    let token = signed_with(&root, |c| c["iat"] = serde_json::json!(i64::MIN));
    let reason = refusal(&run(&token, &production_policy(), &root.jwks()), "iat");
    assert!(reason.contains("out of range"), "{reason}");
}

/// A token without `kid` was reported as `no key with kid ""`.
#[test]
fn a_token_without_kid_says_so() {
    let root = TestRoot::load();
    let token = sign_raw(
        &root,
        r#"{"alg":"RS256","typ":"JWT"}"#,
        &good_claims().to_json().to_string(),
    );
    let reason = refusal(
        &run(&token, &production_policy(), &root.jwks()),
        "signature",
    );
    assert!(reason.contains("names no `kid`"), "{reason}");
}
