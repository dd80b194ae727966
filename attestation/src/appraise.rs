//! Appraisal of a Confidential Space attestation token against a policy: every check records one
//! result in a `VerificationReport`, and the report decides (deny by default). The verification
//! time is an input; nothing here reads a clock.

use serde_json::Value;

use crate::jwk::Jwk;
use crate::jws::{self, UnverifiedJws};
use crate::policy::AppraisalPolicy;
use crate::report::VerificationReport;

/// What this verifier expects of the token, besides the policy.
#[derive(Debug, Clone)]
pub struct Expectations<'a> {
    /// This key service's own audience.
    pub audience: &'a str,
    /// The challenge nonce this key service issued.
    pub nonce: &'a str,
    /// Lowercase hex SHA-256 of the enclave's ephemeral public key, which `eat_nonce` must carry.
    pub key_binding: &'a str,
    /// Verification time, Unix seconds.
    pub now_unix: i64,
}

/// The outcome of one appraisal, with what the audit log records.
#[derive(Debug, Clone)]
pub struct Appraisal {
    pub report: VerificationReport,
    /// Lowercase hex SHA-256 of the token text.
    pub token_sha256: String,
    /// `submods.container.image_digest`, if the token has one (recorded even when refused).
    pub image_digest: Option<String>,
}

/// Lowercase hex SHA-256, as used for `key_binding` and token hashes.
pub use confed_protocol::hex::sha256_hex;

/// Parses a token; on a malformed token the appraisal has one failed check, `token_format`.
pub fn parse_or_refuse(token: &str) -> Result<UnverifiedJws, Appraisal> {
    jws::parse(token).map_err(|e| {
        let mut report = VerificationReport::new();
        report.record("token_format", Err(e.to_string()));
        Appraisal {
            report,
            token_sha256: sha256_hex(token.as_bytes()),
            image_digest: None,
        }
    })
}

/// Runs every check of the policy on a parsed token. `key` is the policy's key for the token's
/// `kid`, or `None` if the policy's key set has none.
pub fn appraise(
    token_text: &str,
    jws: &UnverifiedJws,
    key: Option<&Jwk>,
    policy: &AppraisalPolicy,
    expect: &Expectations<'_>,
) -> Appraisal {
    let claims = &jws.payload;
    let mut report = VerificationReport::new();
    let skew = i64::from(policy.token.max_clock_skew_seconds);

    report.record(
        "algorithm",
        if jws.header.alg == policy.token.algorithm.as_str() {
            Ok(())
        } else {
            Err(format!(
                "token says alg {:?}; the policy accepts only {}",
                jws.header.alg,
                policy.token.algorithm.as_str()
            ))
        },
    );
    report.record(
        "signature",
        match (key, jws.header.kid.as_deref()) {
            (Some(key), _) => jws.verify_signature(policy.token.algorithm, key),
            (None, None) => {
                Err("the token header names no `kid`; the policy's key set is chosen by kid".into())
            }
            (None, Some(kid)) => Err(format!("no key with kid {kid:?} in the policy's key set")),
        },
    );
    report.record("iss", equals(claims, "iss", &policy.token.issuer));
    report.record("aud", audience(claims, expect.audience));
    // Checked arithmetic throughout: a claim near i64::MAX must not wrap into the valid range.
    report.record(
        "exp",
        number(claims, "exp").and_then(|exp| match exp.checked_add(skew) {
            Some(limit) if expect.now_unix < limit => Ok(()),
            Some(_) => Err(format!(
                "token expired at {exp}; now is {}",
                expect.now_unix
            )),
            None => Err(format!("exp {exp} is out of range")),
        }),
    );
    report.record(
        "nbf",
        number(claims, "nbf").and_then(|nbf| match expect.now_unix.checked_add(skew) {
            Some(now) if now >= nbf => Ok(()),
            _ => Err(format!(
                "token not valid before {nbf}; now is {}",
                expect.now_unix
            )),
        }),
    );
    report.record(
        "iat",
        number(claims, "iat").and_then(|iat| {
            let age = expect
                .now_unix
                .checked_sub(iat)
                .ok_or_else(|| format!("iat {iat} is out of range"))?;
            let max_age = i64::from(policy.token.max_token_age_seconds).saturating_add(skew);
            if age < -skew {
                Err(format!("token issued in the future ({iat})"))
            } else if age > max_age {
                Err(format!(
                    "token is {age} s old; the policy accepts at most {} s",
                    policy.token.max_token_age_seconds
                ))
            } else {
                Ok(())
            }
        }),
    );
    let nonces = strings(claims, "eat_nonce");
    report.record(
        "eat_nonce",
        nonces.clone().and_then(|nonces| {
            if nonces.iter().any(|n| n == expect.nonce) {
                Ok(())
            } else {
                Err("eat_nonce does not contain this key service's challenge nonce".into())
            }
        }),
    );
    report.record(
        "key_binding",
        nonces.and_then(|nonces| {
            if nonces.iter().any(|n| n == expect.key_binding) {
                Ok(())
            } else {
                Err("eat_nonce does not contain the SHA-256 of the ephemeral public key".into())
            }
        }),
    );
    let platform = &policy.platform;
    report.record("swname", equals(claims, "swname", &platform.swname));
    report.record("dbgstat", equals(claims, "dbgstat", &platform.dbgstat));
    report.record(
        "hwmodel",
        match claims.get("hwmodel").and_then(Value::as_str) {
            Some(model) if platform.hardware_models.iter().any(|m| m == model) => Ok(()),
            Some(model) => Err(format!("hwmodel {model:?} is not allowed by the policy")),
            None => Err("hwmodel is missing".into()),
        },
    );
    report.record(
        "secboot",
        match (platform.require_secure_boot, claims.get("secboot")) {
            (false, _) | (true, Some(Value::Bool(true))) => Ok(()),
            (true, _) => Err("secure boot is not attested (secboot != true)".into()),
        },
    );
    if let Some(required) = &platform.support_attribute {
        report.record(
            "support_attributes",
            strings(claims, "/submods/confidential_space/support_attributes").and_then(
                |attributes| {
                    if attributes.iter().any(|a| a == required) {
                        Ok(())
                    } else {
                        Err(format!(
                            "support_attributes {attributes:?} lacks {required:?}"
                        ))
                    }
                },
            ),
        );
    }
    report.record("swversion", swversion(claims, platform.min_swversion));
    let image_digest = pointer(claims, "/submods/container/image_digest")
        .and_then(Value::as_str)
        .map(str::to_string);
    report.record(
        "image_digest",
        match &image_digest {
            None => Err("submods.container.image_digest is missing".into()),
            Some(d) if policy.workload.image_digests.iter().any(|a| a == d) => Ok(()),
            Some(d) => Err(format!(
                "image digest {d} is not in the policy's allow-list"
            )),
        },
    );
    let workload = &policy.workload;
    if !workload.service_accounts.is_empty() {
        report.record(
            "service_account",
            strings(claims, "google_service_accounts").and_then(|accounts| {
                if accounts
                    .iter()
                    .any(|a| workload.service_accounts.contains(a))
                {
                    Ok(())
                } else {
                    Err(format!("service accounts {accounts:?} are not allowed"))
                }
            }),
        );
    }
    if !workload.project_ids.is_empty() {
        report.record(
            "project",
            match pointer(claims, "/submods/gce/project_id").and_then(Value::as_str) {
                Some(p) if workload.project_ids.iter().any(|a| a == p) => Ok(()),
                other => Err(format!("project {other:?} is not allowed")),
            },
        );
    }
    report.record(
        "cmd_override",
        match pointer(claims, "/submods/container/cmd_override") {
            None | Some(Value::Null) => Ok(()),
            Some(Value::Array(a)) if a.is_empty() => Ok(()),
            Some(_) if workload.allow_cmd_override => Ok(()),
            Some(_) => Err("the container command was overridden; the policy forbids it".into()),
        },
    );
    report.record(
        "env_override",
        env_override(claims, &workload.allowed_env_overrides),
    );

    Appraisal {
        report,
        token_sha256: sha256_hex(token_text.as_bytes()),
        image_digest,
    }
}

fn pointer<'a>(claims: &'a Value, path: &str) -> Option<&'a Value> {
    claims.pointer(path)
}

/// A claim that is a string or an array of strings, as its strings. `name` is a top-level claim
/// or a JSON pointer. Any other shape, or an array with any entry that is not a string, is
/// refused whole: dropping the odd entries would let `["ours", 123]` count as one audience.
fn strings(claims: &Value, name: &str) -> Result<Vec<String>, String> {
    let value = if name.starts_with('/') {
        claims.pointer(name)
    } else {
        claims.get(name)
    };
    let shown = name.trim_start_matches('/').replace('/', ".");
    match value {
        None | Some(Value::Null) => Err(format!("{shown} is missing")),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    format!("{shown} has an entry that is not a string ({v}); refusing the token")
                })
            })
            .collect(),
        Some(other) => Err(format!(
            "{shown} is not a string or an array of strings (got {other})"
        )),
    }
}

fn equals(claims: &Value, name: &str, expected: &str) -> Result<(), String> {
    match claims.get(name).and_then(Value::as_str) {
        Some(v) if v == expected => Ok(()),
        Some(v) => Err(format!("{name} is {v:?}; the policy requires {expected:?}")),
        None => Err(format!("{name} is missing")),
    }
}

fn number(claims: &Value, name: &str) -> Result<i64, String> {
    claims
        .get(name)
        .and_then(Value::as_i64)
        .ok_or_else(|| format!("{name} is missing or not an integer"))
}

/// Exactly one audience, equal to ours: a token for several verifiers could be replayed among them.
fn audience(claims: &Value, expected: &str) -> Result<(), String> {
    let audiences = strings(claims, "aud")?;
    match audiences.as_slice() {
        [only] if only == expected => Ok(()),
        [] => Err("aud is an empty array".into()),
        other => Err(format!(
            "aud {other:?} is not exactly this key service's {expected:?}"
        )),
    }
}

fn swversion(claims: &Value, minimum: u64) -> Result<(), String> {
    let versions = strings(claims, "swversion")?;
    if versions.is_empty() {
        return Err("swversion is an empty array".into());
    }
    for version in &versions {
        // Digits only: `u64::from_str` also takes a leading `+`.
        let digits = !version.is_empty() && version.bytes().all(|b| b.is_ascii_digit());
        match version.parse::<u64>().ok().filter(|_| digits).ok_or(()) {
            Ok(v) if v >= minimum => {}
            Ok(v) => {
                return Err(format!(
                    "swversion {v} is below the policy's minimum {minimum}"
                ));
            }
            Err(_) => return Err(format!("swversion {version:?} is not a number")),
        }
    }
    Ok(())
}

fn env_override(claims: &Value, allowed: &[String]) -> Result<(), String> {
    match pointer(claims, "/submods/container/env_override") {
        None | Some(Value::Null) => Ok(()),
        Some(Value::Object(vars)) => {
            let refused: Vec<_> = vars.keys().filter(|k| !allowed.contains(k)).collect();
            if refused.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "environment overrides {refused:?} are not allowed by the policy"
                ))
            }
        }
        Some(_) => Err("env_override is not an object".into()),
    }
}
