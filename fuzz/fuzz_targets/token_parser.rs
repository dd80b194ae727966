//! Any bytes as an attestation token: parsing and appraisal must never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(token) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(jws) = confed_attestation::jws::parse(token) {
        let policy = confed_attestation::AppraisalPolicy::from_toml(POLICY).unwrap();
        let expect = confed_attestation::Expectations {
            audience: "aud",
            nonce: "nonce-nonce-nonce",
            key_binding: "binding-binding-binding",
            now_unix: 1_800_000_000,
        };
        let _ = confed_attestation::appraise(token, &jws, None, &policy, &expect);
    }
});

const POLICY: &str = r#"
name = "fuzz"
[token]
issuer = "https://issuer.example"
algorithm = "RS256"
jwks_file = "unused.json"
max_clock_skew_seconds = 60
max_token_age_seconds = 600
[platform]
swname = "CONFIDENTIAL_SPACE"
dbgstat = "disabled-since-boot"
hardware_models = ["GCP_AMD_SEV"]
require_secure_boot = true
support_attribute = "STABLE"
min_swversion = 1
[workload]
image_digests = []
service_accounts = ["a@b"]
project_ids = ["p"]
"#;
