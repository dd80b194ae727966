//! The front end's view of the key services: their signed key sets, fetched at start and
//! refreshed periodically. Assignments carry the round's key with every key service's signature,
//! and the device decides whether T trusted signatures are among them.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use confed_attestation::exchange::{KeySet, SignedPublicKey};

use super::KeyState;

/// How often a server fetches the key services' key sets again.
pub const REFRESH_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);
pub use confed_protocol::keys::{DeviceKey, KeySignature};

#[derive(Debug, Clone, Default)]
pub struct KeyDirectory {
    sets: Arc<RwLock<Vec<KeySet>>>,
    /// Which key service answered at each URL (its key set's `keyservice_id`), as of the last
    /// refresh it answered.
    answered_at: Arc<RwLock<std::collections::HashMap<String, String>>>,
    /// (answered, asked) at the last refresh; `None` for a fixed directory (never refreshed).
    reach: Arc<RwLock<Option<(usize, usize)>>>,
}

impl KeyDirectory {
    pub fn fixed(sets: Vec<KeySet>) -> Self {
        Self {
            sets: Arc::new(RwLock::new(sets)),
            answered_at: Arc::default(),
            reach: Arc::default(),
        }
    }

    /// Whether devices can be assigned: an active key signed by its threshold of key services is
    /// known (kept from earlier refreshes while key services are unreachable: the signatures
    /// stay valid). `Err` says what is missing, with how many key services answered the last
    /// refresh. A fixed directory is always ready.
    pub fn readiness(&self, now: i64) -> Result<(), String> {
        let Some((answered, asked)) = self.reach.read().ok().and_then(|r| *r) else {
            return Ok(());
        };
        if self.current_key(now).is_some() {
            return Ok(());
        }
        Err(format!(
            "no active device key signed by its threshold of key services is known \
             ({answered} of {asked} key services answered the last refresh): devices cannot be \
             assigned; check the key services' reachability and their keys' validity"
        ))
    }

    /// The id of the key service that answered at `url` (its key set's own word).
    pub fn keyservice_at(&self, url: &str) -> Option<String> {
        self.answered_at.read().ok()?.get(url).cloned()
    }

    pub fn replace(&self, sets: Vec<KeySet>) {
        if let Ok(mut current) = self.sets.write() {
            *current = sets;
        }
    }

    fn collect(&self, wanted: impl Fn(&SignedPublicKey) -> bool) -> Vec<DeviceKey> {
        let Ok(sets) = self.sets.read() else {
            return Vec::new();
        };
        let mut keys: Vec<DeviceKey> = Vec::new();
        for set in sets.iter() {
            for key in set.keys.iter().filter(|k| wanted(k)) {
                let signature = KeySignature {
                    keyservice_id: set.keyservice_id.clone(),
                    signature: key.signature.clone(),
                };
                let same = |d: &DeviceKey| {
                    d.key_id == key.key_id
                        && d.public_key == key.public_key
                        && (d.not_before, d.not_after, d.threshold, d.shares)
                            == (key.not_before, key.not_after, key.threshold, key.shares)
                };
                match keys.iter_mut().find(|d| same(d)) {
                    Some(existing) => existing.signatures.push(signature),
                    None => keys.push(DeviceKey {
                        key_id: key.key_id.clone(),
                        suite: key.suite.clone(),
                        public_key: key.public_key.clone(),
                        not_before: key.not_before,
                        not_after: key.not_after,
                        threshold: key.threshold,
                        shares: key.shares,
                        signatures: vec![signature],
                    }),
                }
            }
        }
        keys
    }

    /// (key service id, verifying key) of every key service whose key set is known: whose
    /// receipts the front end accepts.
    pub fn verifying_keys(&self) -> Vec<(String, p256::ecdsa::VerifyingKey)> {
        let Ok(sets) = self.sets.read() else {
            return Vec::new();
        };
        sets.iter()
            .filter_map(|set| {
                confed_attestation::exchange::decode_verifying_key(&set.verifying_key)
                    .map(|key| (set.keyservice_id.clone(), key))
            })
            .collect()
    }

    /// (threshold, shares) of key `key_id` as its key services signed it: the threshold of the
    /// entry whose signatures verify under the signing key services' own keys, from at least its
    /// threshold of distinct key services; as shares, the largest that any validly signed entry
    /// of the key states, and at least the number of distinct key services that list the key.
    /// t colluding key services that sign an entry saying n = t (so that theirs is the only
    /// entry reaching its threshold) cannot lower n below what an honest holder of a share
    /// says, or below the holders there are. `None` when no entry reaches its threshold, or
    /// when two different entries do (the key services disagree: nothing to pin). What the
    /// front end checks a release's receipts against, instead of anything the receipts state.
    pub fn signed_shape(&self, key_id: &str) -> Option<(u16, u16)> {
        let Ok(sets) = self.sets.read() else {
            return None;
        };
        let mut signers: Vec<(&SignedPublicKey, Vec<&str>)> = Vec::new();
        for set in sets.iter() {
            let Some(verifying) =
                confed_attestation::exchange::decode_verifying_key(&set.verifying_key)
            else {
                continue;
            };
            for key in set.keys.iter().filter(|k| k.key_id == key_id) {
                if !confed_protocol::keyset::verify_key(&verifying, &set.keyservice_id, key) {
                    continue;
                }
                let same = |k: &SignedPublicKey| {
                    (
                        &k.public_key,
                        k.not_before,
                        k.not_after,
                        k.threshold,
                        k.shares,
                    ) == (
                        &key.public_key,
                        key.not_before,
                        key.not_after,
                        key.threshold,
                        key.shares,
                    )
                };
                match signers.iter_mut().find(|(k, _)| same(k)) {
                    Some((_, ids)) if !ids.contains(&set.keyservice_id.as_str()) => {
                        ids.push(&set.keyservice_id)
                    }
                    Some(_) => {}
                    None => signers.push((key, vec![&set.keyservice_id])),
                }
            }
        }
        let mut agreed = signers
            .iter()
            .filter(|(k, ids)| ids.len() >= usize::from(k.threshold.max(1)))
            .map(|(k, _)| (k.threshold, k.shares));
        let first = agreed.next()?;
        if !agreed.all(|other| other == first) {
            return None;
        }
        let stated = signers.iter().map(|(k, _)| k.shares).max().unwrap_or(0);
        let holders = signers
            .iter()
            .flat_map(|(_, ids)| ids.iter().copied())
            .collect::<std::collections::BTreeSet<&str>>()
            .len();
        let shares = first
            .1
            .max(stated)
            .max(u16::try_from(holders).unwrap_or(u16::MAX));
        Some((first.0, shares))
    }

    /// The key with this id, with every signature over it.
    pub fn key(&self, key_id: &str) -> Option<DeviceKey> {
        self.collect(|k| k.key_id == key_id)
            .into_iter()
            .max_by_key(|k| k.signatures.len())
    }

    /// The key a new round should use: active now, signed by at least its threshold of key
    /// services, latest `not_before` first.
    pub fn current_key(&self, now: i64) -> Option<DeviceKey> {
        self.collect(|k| KeyState::at(k.not_before, k.not_after, now) == KeyState::Active)
            .into_iter()
            .filter(|k| k.signatures.len() >= usize::from(k.threshold))
            .max_by_key(|k| (k.not_before, k.signatures.len()))
    }

    /// The `masking` line of a masked task created now: the current key's threshold and every
    /// one of its `n` key services (ids ascending) with its verifying key and its masking key,
    /// checked against the key set's own signature. `Err` says what is missing.
    pub fn masking_policy(
        &self,
        now: i64,
    ) -> Result<confed_protocol::policy::MaskingPolicy, String> {
        use confed_protocol::masking_keys::{MaskingPolicy, MaskingService};
        let key = self.current_key(now).ok_or(
            "no active key signed by its threshold of key services is known: start the key services first",
        )?;
        let sets = self
            .sets
            .read()
            .map_err(|_| "the key directory is poisoned".to_string())?;
        let mut services: Vec<MaskingService> = sets
            .iter()
            .filter_map(|set| {
                let service = MaskingService {
                    keyservice_id: set.keyservice_id.clone(),
                    verifying_key: set.verifying_key.clone(),
                    key: set.masking_key.clone()?,
                };
                service.signed().then_some(service)
            })
            .collect();
        services.sort_by(|a, b| a.keyservice_id.cmp(&b.keyservice_id));
        services.dedup_by(|a, b| a.keyservice_id == b.keyservice_id);
        if services.len() != usize::from(key.shares) {
            return Err(format!(
                "secure aggregation needs a signed masking key from each of the key's {} key services; {} publish one (run each key service with --masking-key)",
                key.shares,
                services.len()
            ));
        }
        let threshold =
            u8::try_from(key.threshold).map_err(|_| "threshold above 255".to_string())?;
        MaskingPolicy::new(threshold, services)
    }

    /// Fetches every key service's key set; keeps the previous set of any that fails.
    pub async fn refresh(&self, client: &reqwest::Client, urls: &[String]) {
        let mut fresh = Vec::new();
        let asked = urls.len();
        for url in urls {
            let answer = client
                .get(format!("{}/v1/keys", url.trim_end_matches('/')))
                .send()
                .await
                .and_then(|r| r.error_for_status());
            match answer {
                Ok(response) => match response.json::<KeySet>().await {
                    Ok(set) => {
                        if let Ok(mut answered_at) = self.answered_at.write() {
                            answered_at.insert(url.clone(), set.keyservice_id.clone());
                        }
                        fresh.push(set)
                    }
                    Err(error) => {
                        tracing::warn!(%url, %error, "key service sent an unreadable key set")
                    }
                },
                Err(error) => {
                    tracing::warn!(%url, %error, "key service unreachable; keeping its previous key set")
                }
            }
        }
        let answered = fresh.len();
        metrics::gauge!("confed_keyservices_reachable").set(answered as f64);
        // What "reachable" is compared with (the alert rule): the largest threshold among the
        // keys the answering key services hold; kept when none answered.
        if let Some(threshold) = fresh
            .iter()
            .flat_map(|set| set.keys.iter().map(|key| key.threshold))
            .max()
        {
            metrics::gauge!("confed_keyservices_threshold").set(f64::from(threshold));
        }
        // What a release needs (q = max(t, ceil((n + t) / 2)) receipts, docs/operations.md,
        // "Availability of the key services"): fewer reachable than q stops every release even
        // while t still decrypt.
        if let Some(quorum) = fresh
            .iter()
            .flat_map(|set| {
                set.keys
                    .iter()
                    .map(|key| confed_attestation::release::quorum(key.threshold, key.shares))
            })
            .max()
        {
            metrics::gauge!("confed_keyservices_release_quorum").set(quorum as f64);
        }
        if let Ok(mut reach) = self.reach.write() {
            *reach = Some((answered, asked));
        }
        let Ok(mut sets) = self.sets.write() else {
            return;
        };
        for old in sets.iter() {
            if !fresh.iter().any(|f| f.keyservice_id == old.keyservice_id) {
                fresh.push(old.clone());
            }
        }
        *sets = fresh;
    }

    /// Refreshes every `period` (`REFRESH_PERIOD` in the server) until the process ends.
    pub fn spawn_refresh(&self, urls: Vec<String>, period: Duration) {
        // Not ready until the first refresh has answered (it runs in the background).
        if let Ok(mut reach) = self.reach.write()
            && reach.is_none()
        {
            *reach = Some((0, urls.len()));
        }
        let directory = self.clone();
        tokio::spawn(async move {
            let client = confed_protocol::http::client(Duration::from_secs(10));
            loop {
                directory.refresh(&client, &urls).await;
                tokio::time::sleep(period).await;
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A front end whose key services never answered has no key for devices: not ready, and
    /// the reason names the key services.
    #[tokio::test]
    async fn a_directory_no_key_service_answered_is_not_ready() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        drop(listener);
        let directory = KeyDirectory::default();
        assert_eq!(
            directory.readiness(0),
            Ok(()),
            "never refreshed: not judged"
        );
        let client = confed_protocol::http::client(Duration::from_secs(2));
        directory.refresh(&client, &[url.clone(), url]).await;
        let not_ready = directory.readiness(0).unwrap_err();
        assert!(not_ready.contains("0 of 2 key services"), "{not_ready}");
        assert_eq!(KeyDirectory::fixed(Vec::new()).readiness(0), Ok(()));
    }
}
