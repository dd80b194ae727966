//! `confed verify release`: a partner's offline check that a round's release came from an attested
//! enclave that t key services agreed to, against the partner's own trust file (the key services'
//! verifying keys and the threshold), not the server's word. The server only supplies bytes: the
//! manifest as the enclave signed it, the average, and the proof.

use confed_attestation::release::{ReleaseProof, TrustedSigner};
use confed_protocol::policy::sha256_hex;
use confed_worker_api::manifest::Manifest;
use thiserror::Error;

use crate::release_check::commitment_of;
use confed_protocol::trust::TrustConfig;
use confed_protocol::trust::TrustedKeyService;

#[derive(Debug, Error)]
pub enum VerifyError {
    #[error("cannot reach the server")]
    Network(#[source] reqwest::Error),
    #[error("the server answered {status} for {what}: {detail}")]
    Server {
        status: u16,
        what: String,
        detail: String,
    },
    #[error("round {round} of task {task} has no release on this server: {why}")]
    NoRelease {
        task: String,
        round: u64,
        /// What the server says of the round (its latest attempt's state and failure reason).
        why: String,
    },
    #[error("the release of round {0} carries no proof (it predates signed releases)")]
    NoProof(u64),
    #[error("malformed {what}")]
    Malformed {
        what: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("trust file: {0}")]
    Trust(String),
}

/// What the check saw: one line per thing checked (`ok: ...` or `FAILED: ...`), and the failures.
#[derive(Debug, Clone)]
pub struct Verified {
    pub lines: Vec<String>,
    pub failures: Vec<String>,
}

impl Verified {
    /// Whether every check passed.
    pub fn ok(&self) -> bool {
        self.failures.is_empty()
    }
}

struct Fetched {
    proof: ReleaseProof,
    manifest_bytes: Vec<u8>,
    average: Vec<u8>,
}

async fn get(
    http: &reqwest::Client,
    url: &str,
    token: &str,
    what: &str,
) -> Result<Vec<u8>, VerifyError> {
    let response = http
        .get(url)
        .bearer_auth(token)
        .send()
        .await
        .map_err(|e| VerifyError::Network(e.without_url()))?;
    let status = response.status().as_u16();
    let body = response
        .bytes()
        .await
        .map_err(|e| VerifyError::Network(e.without_url()))?;
    if status != 200 {
        let detail = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|p| p["detail"].as_str().map(str::to_string))
            .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
        return Err(VerifyError::Server {
            status,
            what: what.into(),
            detail,
        });
    }
    Ok(body.to_vec())
}

/// What `GET /v1/tasks/{id}/rounds` says of `round`: its latest attempt's state, and why it
/// failed (the server's word: an explanation, not something verified).
fn round_status(rounds: &[u8], round: u64) -> String {
    let list: serde_json::Value = serde_json::from_slice(rounds).unwrap_or_default();
    let latest = list["rounds"].as_array().and_then(|all| {
        all.iter()
            .filter(|r| r["round"].as_u64() == Some(round))
            .max_by_key(|r| r["attempt"].as_u64())
    });
    match latest {
        None => "the round has not started".into(),
        Some(r) => {
            let state = r["state"].as_str().unwrap_or("in an unknown state");
            match r["failure_reason"].as_str() {
                Some(reason) => format!("its attempt {} is {state}: {reason}", r["attempt"]),
                None => format!("its attempt {} is {state}", r["attempt"]),
            }
        }
    }
}

async fn fetch(
    http: &reqwest::Client,
    server: &str,
    token: &str,
    task: &str,
    round: u64,
) -> Result<Fetched, VerifyError> {
    let base = format!("{}/v1/tasks/{task}/releases", server.trim_end_matches('/'));
    let list: serde_json::Value =
        serde_json::from_slice(&get(http, &base, token, "the releases").await?).map_err(|e| {
            VerifyError::Malformed {
                what: "release list".into(),
                source: e,
            }
        })?;
    let entry = list["releases"]
        .as_array()
        .and_then(|all| all.iter().find(|r| r["round"].as_u64() == Some(round)));
    let Some(entry) = entry else {
        let rounds = get(
            http,
            &format!("{}/v1/tasks/{task}/rounds", server.trim_end_matches('/')),
            token,
            "the rounds",
        )
        .await?;
        return Err(VerifyError::NoRelease {
            task: task.into(),
            round,
            why: round_status(&rounds, round),
        });
    };
    let proof = entry
        .get("proof")
        .filter(|p| !p.is_null())
        .ok_or(VerifyError::NoProof(round))?;
    let proof: ReleaseProof =
        serde_json::from_value(proof.clone()).map_err(|e| VerifyError::Malformed {
            what: "proof".into(),
            source: e,
        })?;
    let manifest_bytes = get(
        http,
        &format!("{base}/{round}/manifest"),
        token,
        "the manifest",
    )
    .await?;
    let average = get(
        http,
        &format!("{base}/{round}/average"),
        token,
        "the average",
    )
    .await?;
    Ok(Fetched {
        proof,
        manifest_bytes,
        average,
    })
}

/// Fetches round `round` of `task` from `server` and checks it against `trust`.
pub async fn verify_release(
    server: &str,
    token: &str,
    task: &str,
    round: u64,
    trust: &TrustConfig,
) -> Result<Verified, VerifyError> {
    verify_release_under(server, token, task, round, trust, None).await
}

/// `verify_release`, also requiring the release to be under `expected_policy` (the exact text
/// of the task policy the partner expects).
pub async fn verify_release_under(
    server: &str,
    token: &str,
    task: &str,
    round: u64,
    trust: &TrustConfig,
    expected_policy: Option<&str>,
) -> Result<Verified, VerifyError> {
    let http = confed_protocol::http::client(std::time::Duration::from_secs(30));
    let fetched = fetch(&http, server, token, task, round).await?;
    let mut verified = check(
        &fetched.proof,
        &fetched.manifest_bytes,
        &fetched.average,
        task,
        round,
        trust,
    )?;
    let manifest: Manifest =
        serde_json::from_slice(&fetched.manifest_bytes).map_err(|e| VerifyError::Malformed {
            what: "manifest".into(),
            source: e,
        })?;
    if let Some((ok, what)) = blt_chain(&http, server, token, task, &manifest).await? {
        verified
            .lines
            .push(format!("{}: {what}", if ok { "ok" } else { "FAILED" }));
        if !ok {
            verified.failures.push(what);
        }
    }
    if let Some(text) = expected_policy {
        let (ok, what) = match confed_protocol::policy::TaskPolicy::parse(text) {
            Ok(policy) => (
                sha256_hex(text.as_bytes()) == manifest.policy_sha256,
                format!(
                    "the release names the expected policy {} (epsilon {}, delta {}, clip norm {} (the first round's under adaptive clipping), {} rounds, min_reports {})",
                    sha256_hex(text.as_bytes()),
                    policy.epsilon,
                    policy.delta,
                    policy.clip_norm,
                    policy.rounds,
                    policy.min_reports
                ),
            ),
            Err(e) => (
                false,
                format!("the expected policy is not a task policy: {e}"),
            ),
        };
        verified
            .lines
            .push(format!("{}: {what}", if ok { "ok" } else { "FAILED" }));
        if !ok {
            verified.failures.push(what);
        }
    }
    Ok(verified)
}

/// Under BLT noise, whether the state the release continued is the one round `round - 1`'s
/// release names as left (round 1: none): the chain of states through the task's releases
/// (docs/privacy.md, "DP-FTRL with BLT noise"). `None` for other mechanisms.
async fn blt_chain(
    http: &reqwest::Client,
    server: &str,
    token: &str,
    task: &str,
    manifest: &Manifest,
) -> Result<Option<(bool, String)>, VerifyError> {
    let Some(blt) = &manifest.noise.blt else {
        return Ok(None);
    };
    let round = manifest.round;
    if round <= 1 {
        return Ok(Some((
            blt.state_in_blake3.is_none(),
            "BLT: round 1 starts from zero buffers (it names no state it continued)".into(),
        )));
    }
    let url = format!(
        "{}/v1/tasks/{task}/releases/{}/manifest",
        server.trim_end_matches('/'),
        round - 1
    );
    let previous: Manifest =
        serde_json::from_slice(&get(http, &url, token, "the previous round's manifest").await?)
            .map_err(|e| VerifyError::Malformed {
                what: "the previous round's manifest".into(),
                source: e,
            })?;
    let left = previous.noise.blt.map(|b| b.state_out_blake3);
    Ok(Some((
        left.is_some() && left == blt.state_in_blake3,
        format!(
            "BLT: the state this round continued ({}) is the one round {}'s release left ({})",
            blt.state_in_blake3.as_deref().unwrap_or("none"),
            round - 1,
            left.as_deref().unwrap_or("none")
        ),
    )))
}

/// The offline part: everything from bytes.
pub fn check(
    proof: &ReleaseProof,
    manifest_bytes: &[u8],
    average: &[u8],
    task: &str,
    round: u64,
    trust: &TrustConfig,
) -> Result<Verified, VerifyError> {
    let manifest: Manifest =
        serde_json::from_slice(manifest_bytes).map_err(|e| VerifyError::Malformed {
            what: "manifest".into(),
            source: e,
        })?;
    let mut lines = Vec::new();
    let mut failures = Vec::new();
    let mut note = |ok: bool, what: String| {
        lines.push(format!("{}: {what}", if ok { "ok" } else { "FAILED" }));
        if !ok {
            failures.push(what);
        }
    };
    note(
        manifest.task_id == task && manifest.round == round,
        format!(
            "the manifest is for task {} round {} (asked: task {task} round {round})",
            manifest.task_id, manifest.round
        ),
    );
    let average_sha256 = sha256_hex(average);
    note(
        average_sha256 == manifest.average_sha256,
        format!("the average's bytes hash to the manifest's average_sha256 ({average_sha256})"),
    );
    trust
        .check()
        .map_err(|e| VerifyError::Trust(e.to_string()))?;
    let trusted: Vec<TrustedKeyService> = trust
        .keyservices
        .iter()
        .map(|k| {
            TrustedKeyService::new(&k.id, &k.verifying_key).ok_or_else(|| {
                VerifyError::Trust(format!("key service {}: bad verifying_key", k.id))
            })
        })
        .collect::<Result<_, _>>()?;
    let signers: Vec<TrustedSigner<'_>> = trusted
        .iter()
        .map(|t| TrustedSigner {
            id: &t.id,
            verifying_key: &t.verifying_key,
        })
        .collect();
    let result = proof.check(
        &commitment_of(&manifest),
        &sha256_hex(manifest_bytes),
        &average_sha256,
        &signers,
        confed_attestation::release::KeySetShape::new(trust.threshold, trust.shares()),
    );
    let proof_ok = result.failures.is_empty();
    lines.extend(result.lines);
    failures.extend(result.failures);
    if proof_ok {
        if let Some(e) = &manifest.evaluation {
            lines.push(format!(
                "evaluation of model version {}{}: accuracy {}, loss {}, over {:.0} examples (noise {:.1} examples per sum)",
                e.model_version,
                if e.on_demand { " (on demand)" } else { "" },
                e.accuracy.map_or("none".into(), |a| format!("{a:.4}")),
                e.loss.map_or("none".into(), |l| format!("{l:.4}")),
                e.examples,
                e.stddev
            ));
        }
        if let Some(h) = &manifest.health {
            lines.push(format!(
                "health: {} of {} included devices sent zeros in place of a trained update, noised (standard deviation {:.2} devices; the count may fall outside 0..={})",
                h.zeroed, manifest.included, h.stddev, manifest.included
            ));
        }
        // A DP-FTRL release's own noise is not its guarantee (docs/privacy.md, "Reading a
        // DP-FTRL manifest", "Reading a BLT manifest"): the guarantee goes first, then the rest.
        if let Some(guarantee) = guarantee_line(&manifest) {
            lines.insert(0, guarantee);
        }
        lines.push(format!(
            "released under: policy {}, base model {}, mechanism {}, clip norm {}, {} contributions included, epsilon budget {} (delta {}) over {} rounds, spent through this round {:.4}",
            manifest.policy_sha256,
            manifest.model_sha256,
            manifest.noise.mechanism,
            manifest.clip_norm,
            manifest.included,
            manifest.privacy.epsilon_budget,
            manifest.privacy.delta,
            manifest.privacy.rounds_planned,
            manifest.privacy.epsilon_spent
        ));
    }
    Ok(Verified { lines, failures })
}

/// What the accounting guarantees on one device's contribution to a DP-FTRL round (tree or BLT),
/// or to a masked round whose key services drew the noise, beside what the release alone carries; `None` for independent noise (the two are the same)
/// and for releases of servers that did not record it.
fn guarantee_line(manifest: &Manifest) -> Option<String> {
    let noise = &manifest.noise;
    if let Some(masking) = &manifest.masking
        && let Some(variance) = masking.noise_variance_grid
    {
        let accounted =
            (variance as f64).sqrt() * manifest.clip_norm / noise.grid_units_per_clip as f64;
        return Some(format!(
            "noise: distributed: each of the {} groups of key services added a discrete Gaussian of standard deviation {accounted:.6} per coordinate of the sum, and the enclave none; the accounting guarantees {accounted:.6} on one device's contribution even to whoever holds the enclave and {} key services; this release carries {:.6}",
            masking.groups,
            masking.quorum.saturating_sub(1),
            noise.stddev_sum
        ));
    }
    if let Some(tree) = &noise.tree {
        let (accounted, depth) = (tree.accounted_stddev_sum?, tree.accounted_depth?);
        return Some(format!(
            "noise: the accounting guarantees {accounted:.6} per coordinate of the sum on one device's contribution, even to whoever knows every other round of tree {} ({depth} complete nodes over a round); this release alone carries {:.6}",
            tree.tree, noise.stddev_sum
        ));
    }
    let blt = noise.blt.as_ref()?;
    let (accounted, sensitivity) = (blt.accounted_stddev_sum?, blt.accounted_sensitivity?);
    Some(format!(
        "noise: the accounting guarantees {accounted:.6} per coordinate of the sum on one device's contribution, even to whoever knows every other contribution and every release of the task's {} planned rounds (sensitivity {sensitivity:.4} clip norms); this release alone carries {:.6}",
        manifest.privacy.rounds_planned, noise.stddev_sum
    ))
}
