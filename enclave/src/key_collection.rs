//! Getting a task's private key inside the enclave: attest to each of the n key services at once
//! (challenge -> token -> release), stop as soon as T shares reconstruct the key that matches the
//! public key, and name every key service that failed and why. A key service that returns a share
//! inconsistent with the others is found by trying subsets and named as such. Nothing partial is
//! kept: shares are wiped when this returns.

use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_attestation::exchange::{Challenge, ReleaseRequest, ReleaseResponse};
use confed_attestation::{Attester, TokenRequest, sha256_hex};
use futures_util::stream::{FuturesUnordered, StreamExt};
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
}

/// Why one key service gave no usable share.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ServiceFailure {
    #[error("unreachable: {0}")]
    Unreachable(String),
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    #[error("refused ({status}): {detail}")]
    Refused { status: u16, detail: String },
    #[error("attester failed: {0}")]
    Attester(String),
    #[error("malformed answer: {0}")]
    BadAnswer(String),
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
    #[error("no {threshold} of the shares for key {key_id} reconstruct its public key; at least one key service lied and there are too few others to tell which ({}), other failures: {}", .suspects.join(", "), describe(.failures))]
    Inconsistent {
        key_id: String,
        threshold: u16,
        suspects: Vec<String>,
        failures: Vec<(String, ServiceFailure)>,
    },
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

/// Collects shares concurrently and reconstructs the private key of `request`.
pub async fn obtain_private_key(
    client: &reqwest::Client,
    services: &[KeyServiceEndpoint],
    request: &KeyRequest,
    attester: &dyn Attester,
    per_service_timeout: Duration,
) -> Result<ObtainedKey, CollectError> {
    // One fresh ephemeral key for this collection; every token binds its hash.
    let (ephemeral_private, ephemeral_public) = hpke::generate_keypair();
    let mut pending: FuturesUnordered<_> = services
        .iter()
        .map(|service| {
            let ephemeral = (&ephemeral_private, &ephemeral_public);
            async move {
                let outcome = tokio::time::timeout(
                    per_service_timeout,
                    fetch_share(client, service, request, attester, ephemeral),
                )
                .await
                .unwrap_or(Err(ServiceFailure::Timeout(per_service_timeout)));
                (service.id.clone(), outcome)
            }
        })
        .collect();

    let mut collected: Vec<(String, Share)> = Vec::new();
    let mut failures: Vec<(String, ServiceFailure)> = Vec::new();
    while let Some((id, outcome)) = pending.next().await {
        match outcome {
            Err(why) => {
                tracing::warn!(keyservice = %id, %why, "no share");
                failures.push((id, why));
            }
            Ok(share) => {
                collected.push((id, share));
                if collected.len() >= usize::from(request.threshold)
                    && let Some((private_key, used, liars)) =
                        reconstruct(&collected, request.threshold, &request.public_key)
                {
                    failures.extend(
                        liars
                            .into_iter()
                            .map(|id| (id, ServiceFailure::InconsistentShare)),
                    );
                    return Ok(ObtainedKey {
                        private_key,
                        used,
                        failures,
                    });
                }
            }
        }
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
    (ephemeral_private, ephemeral_public): (&PrivateKey, &PublicKey),
) -> Result<Share, ServiceFailure> {
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
            nonces: vec![challenge.nonce.clone(), sha256_hex(&ephemeral_public.0)],
        })
        .await
        .map_err(|e| ServiceFailure::Attester(e.to_string()))?;
    let release = ReleaseRequest {
        token,
        ephemeral_public_key: URL_SAFE_NO_PAD.encode(ephemeral_public.0),
        nonce: challenge.nonce.clone(),
        task_id: request.task_id.clone(),
        round: request.round,
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
    let info = hpke::share_release_info(
        &service.id,
        &request.key_id,
        &request.task_id,
        request.round,
    );
    let share = hpke::open(
        ephemeral_private,
        &encapsulated,
        &info,
        challenge.nonce.as_bytes(),
        &ciphertext,
    )
    .map_err(|e| ServiceFailure::BadAnswer(e.to_string()))?;
    if share.len() != 1 + hpke::KEY_BYTES || share[0] == 0 {
        return Err(ServiceFailure::BadAnswer(
            "the share has the wrong shape".into(),
        ));
    }
    Ok(share)
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
        .map_err(|e| ServiceFailure::Unreachable(e.to_string()))?;
    let status = response.status();
    if !status.is_success() {
        let text = response.text().await.unwrap_or_default();
        let detail = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|problem| {
                problem
                    .get("detail")
                    .and_then(|d| d.as_str())
                    .map(str::to_string)
            })
            .unwrap_or(text);
        return Err(ServiceFailure::Refused {
            status: status.as_u16(),
            detail,
        });
    }
    response
        .json()
        .await
        .map_err(|e| ServiceFailure::BadAnswer(e.to_string()))
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
