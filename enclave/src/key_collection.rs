//! Getting a task's private key inside the enclave: attest to each of the n key services at once
//! (challenge -> token -> release, with the round's release commitment), reconstruct the key that
//! matches the public key from T shares, give the others a short grace to answer too (each that
//! answers records the commitment in its ledger and signs a receipt: the more ledgers hold it,
//! the more rolled-back key services the one-release rule survives), and name every key service
//! that failed and why. A key
//! service that returns a share inconsistent with the others is found by trying subsets and named
//! as such. Nothing partial is kept: shares are wiped when this returns.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_attestation::exchange::{
    Challenge, ReleaseRequest, ReleaseResponse, encode_verifying_key,
};
use confed_attestation::release::{Receipt, ReleaseCommitment, key_binding, quorum};
use confed_attestation::{Attester, TokenRequest};
use futures_util::stream::{FuturesUnordered, StreamExt};
use p256::ecdsa::SigningKey;
use thiserror::Error;
use zeroize::Zeroizing;

use crate::hpke::{self, PrivateKey, PublicKey};
use crate::shares;

/// Where one key service is reached, and the id it signs and seals under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyServiceEndpoint {
    pub id: String,
    /// Base URL, e.g. `https://ks1.example.org`.
    pub url: String,
}

/// Which key, for what.
#[derive(Debug, Clone)]
pub struct KeyRequest {
    pub key_id: String,
    pub public_key: PublicKey,
    pub threshold: u16,
    pub task_id: String,
    pub round: u64,
    /// What the round's release depends on: recorded by every key service that answers.
    pub commitment: ReleaseCommitment,
    /// The task policy text the commitment names.
    pub policy: String,
}

/// Why one key service gave no usable share.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ServiceFailure {
    #[error("unreachable: {0}")]
    Unreachable(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("refused ({status}): {detail}")]
    Refused {
        status: u16,
        detail: String,
        /// The `check` names of the problem's `failed_checks` (docs/protocol.md): what the
        /// enclave decides on, never the detail's text.
        failed_checks: Vec<String>,
    },
    #[error("attester failed: {0}")]
    Attester(String),
    #[error("malformed answer: {0}")]
    BadAnswer(String),
    #[error("its receipt is not for this commitment or enclave key: {0}")]
    BadReceipt(String),
    #[error("returned a share inconsistent with the others (corrupted or lying)")]
    InconsistentShare,
}

/// The key, and what happened on the way.
#[derive(Debug)]
pub struct ObtainedKey {
    pub private_key: PrivateKey,
    /// Key services whose shares reconstructed the key.
    pub used: Vec<String>,
    /// Key services that gave no usable share, with why (including liars found).
    pub failures: Vec<(String, ServiceFailure)>,
    /// The receipts of every key service whose share is consistent with the key.
    pub receipts: Vec<Receipt>,
}

#[derive(Debug, Error)]
pub enum CollectError {
    #[error("only {usable} usable shares of the {threshold} needed for key {key_id}: {}", describe(.failures))]
    NotEnoughShares {
        key_id: String,
        threshold: u16,
        usable: usize,
        failures: Vec<(String, ServiceFailure)>,
    },
    #[error("the key {key_id} was reconstructed, but only {recorded} key services recorded the release commitment and {needed} must (threshold {threshold} of {shares} shares) before a release may be published: {}", describe(.failures))]
    NoQuorum {
        key_id: String,
        threshold: u16,
        shares: u16,
        recorded: usize,
        needed: usize,
        failures: Vec<(String, ServiceFailure)>,
    },
    #[error("no {threshold} of the shares for key {key_id} reconstruct its public key; at least one key service lied and there are too few others to tell which ({}), other failures: {}", .suspects.join(", "), describe(.failures))]
    Inconsistent {
        key_id: String,
        threshold: u16,
        suspects: Vec<String>,
        failures: Vec<(String, ServiceFailure)>,
    },
}

impl CollectError {
    /// Whether the key services' release ledgers make this failure final: so many of them
    /// refused the commitment under `release_ledger` (another commitment for the round, a closed
    /// task, a round outside the policy) that the shares or the quorum cannot be reached by
    /// asking again. Retrying would only add refusals to their audit logs.
    pub fn refused_by_ledgers(&self) -> bool {
        let ledger_refusals = |failures: &[(String, ServiceFailure)]| {
            failures
                .iter()
                .filter(|(_, f)| {
                    matches!(f, ServiceFailure::Refused { status: 403, failed_checks, .. }
                        if failed_checks.iter().any(|check| check == "release_ledger"))
                })
                .count()
        };
        match self {
            Self::NotEnoughShares {
                threshold,
                usable,
                failures,
                ..
            } => {
                let asked = usable + failures.len();
                ledger_refusals(failures) > asked.saturating_sub(usize::from(*threshold))
            }
            Self::NoQuorum {
                shares,
                needed,
                failures,
                ..
            } => ledger_refusals(failures) > usize::from(*shares).saturating_sub(*needed),
            Self::Inconsistent { .. } => false,
        }
    }
}

fn describe(failures: &[(String, ServiceFailure)]) -> String {
    if failures.is_empty() {
        return "none".into();
    }
    failures
        .iter()
        .map(|(id, why)| format!("{id}: {why}"))
        .collect::<Vec<_>>()
        .join("; ")
}

type Share = Zeroizing<Vec<u8>>;

/// The keys one collection binds into its tokens: a fresh X25519 key the shares are sealed to,
/// and the job's P-256 signing key the receipts are issued to (it later signs the release).
struct SessionKeys<'a> {
    ephemeral_private: PrivateKey,
    ephemeral_public: PublicKey,
    signing_key: &'a SigningKey,
}

/// How long the collection waits for the remaining key services once a quorum has recorded the
/// commitment: each that answers in time records it too.
pub const LEDGER_GRACE: Duration = Duration::from_secs(2);

/// Receipts a release needs: `release::quorum` of the threshold and the largest number of shares
/// an honest (non-lying) key service states for the key.
fn needed(request: &KeyRequest, receipts: &[Receipt], liars: &[String]) -> usize {
    let honest = receipts
        .iter()
        .filter(|r| !liars.contains(&r.keyservice_id));
    let shares = honest.clone().map(|r| r.shares).max().unwrap_or(0);
    let threshold = honest
        .map(|r| r.threshold)
        .max()
        .unwrap_or(0)
        .max(request.threshold);
    quorum(threshold, shares)
}

/// Distinct share holders among the consistent shares: distinct share indices (x), so one holder
/// answering under two names counts once.
fn recorded(collected: &[(String, Share)], liars: &[String]) -> usize {
    collected
        .iter()
        .filter(|(id, _)| !liars.contains(id))
        .map(|(_, share)| share[0])
        .collect::<std::collections::HashSet<u8>>()
        .len()
}

/// Key services that neither answered nor failed (still pending when the grace ended).
fn pending_ids(
    services: &[&KeyServiceEndpoint],
    collected: &[(String, Share)],
    failures: &[(String, ServiceFailure)],
) -> Vec<String> {
    services
        .iter()
        .map(|s| s.id.clone())
        .filter(|id| {
            !collected.iter().any(|(c, _)| c == id) && !failures.iter().any(|(f, _)| f == id)
        })
        .collect()
}

/// Collects shares concurrently from every key service (each within `per_service_timeout`, the
/// others within `LEDGER_GRACE` once T shares reconstruct the key) and reconstructs the private
/// key of `request`.
pub async fn obtain_private_key(
    client: &reqwest::Client,
    services: &[KeyServiceEndpoint],
    request: &KeyRequest,
    attester: &dyn Attester,
    signing_key: &SigningKey,
    per_service_timeout: Duration,
) -> Result<ObtainedKey, CollectError> {
    let (ephemeral_private, ephemeral_public) = hpke::generate_keypair();
    let session = SessionKeys {
        ephemeral_private,
        ephemeral_public,
        signing_key,
    };
    // The list of key services comes from the operator: one entry per id, whatever it lists.
    let mut seen = std::collections::HashSet::new();
    let services: Vec<&KeyServiceEndpoint> = services
        .iter()
        .filter(|s| seen.insert(s.id.clone()))
        .collect();
    let mut pending: FuturesUnordered<_> = services
        .iter()
        .map(|&service| {
            let session = &session;
            async move {
                let outcome = tokio::time::timeout(
                    per_service_timeout,
                    fetch_share(client, service, request, attester, session),
                )
                .await
                .unwrap_or(Err(ServiceFailure::Timeout(per_service_timeout)));
                (service.id.clone(), outcome)
            }
        })
        .collect();

    let mut collected: Vec<(String, Share)> = Vec::new();
    let mut receipts: Vec<Receipt> = Vec::new();
    let mut failures: Vec<(String, ServiceFailure)> = Vec::new();
    // Every share that is consistent with the reconstructed key comes from a real share holder,
    // which recorded the commitment before answering. Collect until a quorum of them has (see
    // `release::quorum`), then give the rest a short grace to record it too.
    let mut grace_until: Option<tokio::time::Instant> = None;
    loop {
        let next = match grace_until {
            None => pending.next().await,
            Some(deadline) => match tokio::time::timeout_at(deadline, pending.next()).await {
                Ok(next) => next,
                Err(_) => break,
            },
        };
        let Some((id, outcome)) = next else { break };
        match outcome {
            Err(why) => {
                tracing::warn!(keyservice = %id, %why, "no share");
                failures.push((id, why));
            }
            Ok((share, receipt)) => {
                collected.push((id, share));
                receipts.push(receipt);
                if grace_until.is_none()
                    && let Some((_, _, liars)) =
                        reconstruct(&collected, request.threshold, &request.public_key)
                    && recorded(&collected, &liars) >= needed(request, &receipts, &liars)
                {
                    grace_until =
                        Some(tokio::time::Instant::now() + LEDGER_GRACE.min(per_service_timeout));
                }
            }
        }
    }
    for id in pending_ids(&services, &collected, &failures) {
        failures.push((id, ServiceFailure::Timeout(LEDGER_GRACE)));
    }
    if collected.len() >= usize::from(request.threshold)
        && let Some((private_key, used, liars)) =
            reconstruct(&collected, request.threshold, &request.public_key)
    {
        receipts.retain(|r| !liars.contains(&r.keyservice_id));
        let needed = needed(request, &receipts, &[]);
        let recorded = recorded(&collected, &liars);
        let shares = receipts.iter().map(|r| r.shares).max().unwrap_or(0);
        failures.extend(
            liars
                .into_iter()
                .map(|id| (id, ServiceFailure::InconsistentShare)),
        );
        if recorded < needed {
            return Err(CollectError::NoQuorum {
                key_id: request.key_id.clone(),
                threshold: request.threshold,
                shares,
                recorded,
                needed,
                failures,
            });
        }
        return Ok(ObtainedKey {
            private_key,
            used,
            failures,
            receipts,
        });
    }
    if collected.len() >= usize::from(request.threshold) {
        Err(CollectError::Inconsistent {
            key_id: request.key_id.clone(),
            threshold: request.threshold,
            suspects: collected.into_iter().map(|(id, _)| id).collect(),
            failures,
        })
    } else {
        Err(CollectError::NotEnoughShares {
            key_id: request.key_id.clone(),
            threshold: request.threshold,
            usable: collected.len(),
            failures,
        })
    }
}

/// Finds `threshold` shares that reconstruct the key matching `public_key`; returns the key, the
/// ids used, and the ids whose shares are inconsistent with it. `None` if no subset works.
pub fn reconstruct(
    collected: &[(String, Share)],
    threshold: u16,
    public_key: &PublicKey,
) -> Option<(PrivateKey, Vec<String>, Vec<String>)> {
    let t = usize::from(threshold);
    let try_subset = |indices: &[usize]| -> Option<PrivateKey> {
        let picked: Vec<&[u8]> = indices.iter().map(|&i| collected[i].1.as_slice()).collect();
        let secret = shares::combine(threshold, &picked).ok()?;
        let key = PrivateKey::from_bytes(&secret).ok()?;
        (key.public_key().ok()? == *public_key).then_some(key)
    };
    let good = combinations(collected.len(), t)
        .find_map(|subset| try_subset(&subset).map(|key| (subset, key)))?;
    let (subset, key) = good;
    // A share outside the good subset is honest iff it can replace a member and still work.
    let liars = (0..collected.len())
        .filter(|i| !subset.contains(i))
        .filter(|&i| {
            let mut probe = subset[..t - 1].to_vec();
            probe.push(i);
            try_subset(&probe).is_none()
        })
        .map(|i| collected[i].0.clone())
        .collect();
    let used = subset.iter().map(|&i| collected[i].0.clone()).collect();
    Some((key, used, liars))
}

/// All `k`-subsets of `0..n`, in lexicographic order.
fn combinations(n: usize, k: usize) -> impl Iterator<Item = Vec<usize>> {
    let mut next = (k <= n && k > 0).then(|| (0..k).collect::<Vec<_>>());
    std::iter::from_fn(move || {
        let current = next.clone()?;
        let mut advanced = current.clone();
        let mut i = k;
        next = loop {
            if i == 0 {
                break None;
            }
            i -= 1;
            if advanced[i] < n - k + i {
                advanced[i] += 1;
                for j in i + 1..k {
                    advanced[j] = advanced[j - 1] + 1;
                }
                break Some(advanced);
            }
        };
        Some(current)
    })
}

async fn fetch_share(
    client: &reqwest::Client,
    service: &KeyServiceEndpoint,
    request: &KeyRequest,
    attester: &dyn Attester,
    session: &SessionKeys<'_>,
) -> Result<(Share, Receipt), ServiceFailure> {
    let signing_public = session.signing_key.verifying_key().to_sec1_point(false);
    let enclave_signing_key = encode_verifying_key(session.signing_key.verifying_key());
    let base = service.url.trim_end_matches('/');
    let challenge: Challenge = post_json(
        client,
        &format!("{base}/v1/keys/{}/challenge", request.key_id),
        &serde_json::json!({}),
    )
    .await?;
    let token = attester
        .token(&TokenRequest {
            audience: challenge.audience.clone(),
            nonces: vec![
                challenge.nonce.clone(),
                key_binding(
                    &session.ephemeral_public.0,
                    signing_public.as_bytes(),
                    &request.commitment.digest(),
                ),
            ],
        })
        .await
        .map_err(|e| ServiceFailure::Attester(confed_protocol::errors::with_causes(&e)))?;
    let release = ReleaseRequest {
        token,
        ephemeral_public_key: URL_SAFE_NO_PAD.encode(session.ephemeral_public.0),
        enclave_signing_key: enclave_signing_key.clone(),
        nonce: challenge.nonce.clone(),
        task_id: request.task_id.clone(),
        round: request.round,
        commitment: request.commitment.clone(),
        policy: request.policy.clone(),
    };
    let answer: ReleaseResponse = post_json(
        client,
        &format!("{base}/v1/keys/{}/release", request.key_id),
        &release,
    )
    .await?;
    if answer.keyservice_id != service.id || answer.key_id != request.key_id {
        return Err(ServiceFailure::BadAnswer(format!(
            "answered as {}/{} instead of {}/{}",
            answer.keyservice_id, answer.key_id, service.id, request.key_id
        )));
    }
    let decode = |field: &str, text: &str| {
        URL_SAFE_NO_PAD
            .decode(text)
            .map_err(|_| ServiceFailure::BadAnswer(format!("{field} is not base64url")))
    };
    let encapsulated = decode("encapsulated_key", &answer.encapsulated_key)?;
    let ciphertext = decode("ciphertext", &answer.ciphertext)?;
    let receipt = &answer.receipt;
    if receipt.keyservice_id != service.id
        || receipt.key_id != request.key_id
        || receipt.task_id != request.task_id
        || receipt.round != request.round
        || receipt.commitment_sha256 != request.commitment.digest()
        || receipt.enclave_signing_key != enclave_signing_key
    {
        return Err(ServiceFailure::BadReceipt(format!(
            "receipt of {} for task {} round {}",
            receipt.keyservice_id, receipt.task_id, receipt.round
        )));
    }
    // The receipt's t and n are bound into the share's HPKE info: a relay that rewrote them (to
    // shrink the quorum) makes the share fail to open.
    let info = hpke::share_release_info(
        &service.id,
        &request.key_id,
        &request.task_id,
        request.round,
        &receipt.commitment_sha256,
        receipt.threshold,
        receipt.shares,
    );
    let share = hpke::open(
        &session.ephemeral_private,
        &encapsulated,
        &info,
        challenge.nonce.as_bytes(),
        &ciphertext,
    )
    .map_err(|e| ServiceFailure::BadAnswer(confed_protocol::errors::with_causes(&e)))?;
    if share.len() != 1 + hpke::KEY_BYTES || share[0] == 0 {
        return Err(ServiceFailure::BadAnswer(
            "the share has the wrong shape".into(),
        ));
    }
    Ok((share, answer.receipt))
}

async fn post_json<T: serde::de::DeserializeOwned>(
    client: &reqwest::Client,
    url: &str,
    body: &impl serde::Serialize,
) -> Result<T, ServiceFailure> {
    let response = client
        .post(url)
        .json(body)
        .send()
        .await
        .map_err(|e| ServiceFailure::Unreachable(confed_protocol::errors::with_causes(&e)))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        let problem = serde_json::from_str::<serde_json::Value>(&text).ok();
        let failed_checks = problem
            .as_ref()
            .and_then(|p| p.get("failed_checks"))
            .and_then(|checks| checks.as_array())
            .map(|checks| {
                checks
                    .iter()
                    .filter_map(|c| c.get("check").and_then(|name| name.as_str()))
                    .map(str::to_string)
                    .collect()
            })
            .unwrap_or_default();
        let detail = problem
            .as_ref()
            .and_then(|p| p.get("detail"))
            .and_then(|d| d.as_str())
            .map(str::to_string)
            .unwrap_or(text);
        return Err(ServiceFailure::Refused {
            status: status.as_u16(),
            detail,
            failed_checks,
        });
    }
    response
        .json()
        .await
        .map_err(|e| ServiceFailure::BadAnswer(confed_protocol::errors::with_causes(&e)))
}

#[cfg(test)]
mod ledger_refusal_tests {
    use super::*;

    fn refused(ledger: bool) -> ServiceFailure {
        let check = if ledger {
            "release_ledger"
        } else {
            "image_digest"
        };
        ServiceFailure::Refused {
            status: 403,
            detail: format!("failed: {check}"),
            failed_checks: vec![check.into()],
        }
    }

    /// 2-of-3: two ledger refusals leave one share, never two: final. One refusal and an
    /// unreachable service may pass on a retry.
    #[test]
    fn a_quorum_of_ledger_refusals_is_final_and_less_is_not() {
        let failures = |kinds: &[Option<bool>]| -> Vec<(String, ServiceFailure)> {
            kinds
                .iter()
                .enumerate()
                .map(|(i, k)| {
                    let failure = match k {
                        Some(ledger) => refused(*ledger),
                        None => ServiceFailure::Unreachable("down".into()),
                    };
                    (format!("ks{i}"), failure)
                })
                .collect()
        };
        let not_enough = |kinds: &[Option<bool>], usable| CollectError::NotEnoughShares {
            key_id: "k".into(),
            threshold: 2,
            usable,
            failures: failures(kinds),
        };
        assert!(not_enough(&[Some(true), Some(true)], 1).refused_by_ledgers());
        assert!(!not_enough(&[Some(true), None], 1).refused_by_ledgers());
        assert!(!not_enough(&[Some(false), Some(false)], 1).refused_by_ledgers());
        let no_quorum = |kinds: &[Option<bool>]| CollectError::NoQuorum {
            key_id: "k".into(),
            threshold: 3,
            shares: 5,
            recorded: 3,
            needed: 4,
            failures: failures(kinds),
        };
        assert!(no_quorum(&[Some(true), Some(true)]).refused_by_ledgers());
        assert!(!no_quorum(&[Some(true), None]).refused_by_ledgers());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shares_for(threshold: u16, n: u16) -> (PublicKey, Vec<(String, Share)>) {
        let (private, public) = hpke::generate_keypair();
        let split = shares::split(private.as_bytes(), threshold, n).unwrap();
        let named = split
            .into_iter()
            .enumerate()
            .map(|(i, s)| (format!("ks{}", i + 1), s))
            .collect();
        (public, named)
    }

    #[test]
    fn combinations_enumerates_every_subset_once() {
        let all: Vec<_> = combinations(4, 2).collect();
        assert_eq!(
            all,
            vec![
                vec![0, 1],
                vec![0, 2],
                vec![0, 3],
                vec![1, 2],
                vec![1, 3],
                vec![2, 3]
            ]
        );
        assert_eq!(combinations(6, 3).count(), 20);
        assert_eq!(combinations(2, 3).count(), 0);
    }

    /// One share holder answering under two names (the operator lists it twice) counts once
    /// toward the quorum of recorded commitments; liars do not count.
    #[test]
    fn the_quorum_counts_distinct_share_holders() {
        let (_, mut collected) = shares_for(2, 3);
        let copy = collected[0].1.clone();
        collected.push(("ks1-again".into(), copy));
        assert_eq!(recorded(&collected, &[]), 3);
        assert_eq!(recorded(&collected, &["ks2".to_string()]), 2);
    }

    #[test]
    fn honest_shares_reconstruct_the_matching_key() {
        let (public, collected) = shares_for(3, 5);
        let (key, used, liars) = reconstruct(&collected[..3], 3, &public).unwrap();
        assert_eq!(key.public_key().unwrap(), public);
        assert_eq!(used, ["ks1", "ks2", "ks3"]);
        assert!(liars.is_empty());
    }

    #[test]
    fn a_corrupted_share_is_found_and_named() {
        let (public, mut collected) = shares_for(3, 5);
        collected[1].1[7] ^= 0x40;
        assert!(
            reconstruct(&collected[..3], 3, &public).is_none(),
            "T shares with a liar fail"
        );
        let (key, used, liars) = reconstruct(&collected[..4], 3, &public).unwrap();
        assert_eq!(key.public_key().unwrap(), public);
        assert!(!used.contains(&"ks2".to_string()));
        assert_eq!(liars, ["ks2"]);
    }
}
