//! Witnessing peers' audit heads: each key service keeps, durably, the latest signed audit head it
//! has seen of each configured peer, and answers a peer that asks what it witnessed of it
//! (`rollback.rs` is the asking side).
//!
//! Heads arrive two ways: a peer pushes its head after each record it appends
//! (`POST /v1/audit/witness`), and this service pulls every peer's head periodically
//! (`GET /v1/audit/head`), which covers pushes lost while either side was down. A head is kept
//! only if its peer's key signed it and it is ahead of the one kept: a stored head moves forward
//! only, so the file is written at most once per record a peer appends. A head behind the one
//! kept, or another hash at the same length, means the peer lost records (or acknowledged a loss
//! and has not yet grown past it): logged and counted, never stored.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use axum::Json;
use axum::extract::State;

use crate::KeyService;
use crate::audit::SignedHead;
use crate::error::KeyServiceApiError as ApiError;
use crate::extract::{ApiBytes, ApiPath};
use crate::peers::{Peers, head_is_signed_by};

const FORMAT: &str = "confed-audit-witness/v1";

/// The witness file beside the audit log.
pub fn path_for(log: &Path) -> PathBuf {
    PathBuf::from(format!("{}.witnessed.json", log.display()))
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct WitnessFile {
    format: String,
    heads: BTreeMap<String, SignedHead>,
}

/// What a verified head of a peer did to the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// Ahead of the kept one (or the first): kept.
    Advanced,
    /// The kept one.
    Same,
    /// Behind the kept one, or another hash at its length: the peer lost records.
    Rewound { witnessed: SignedHead },
}

/// The latest head of each peer, kept in `<audit log>.witnessed.json`.
#[derive(Debug)]
pub struct WitnessStore {
    path: PathBuf,
    heads: BTreeMap<String, SignedHead>,
}

impl WitnessStore {
    /// Opens the store of the log at `log`. An unreadable file is set aside and the store starts
    /// empty: it weakens only the detection of peers' rollbacks, never this service's answers.
    pub fn open(log: &Path) -> Self {
        let path = path_for(log);
        let heads = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<WitnessFile>(&bytes) {
                Ok(file) if file.format == FORMAT => file.heads,
                outcome => {
                    let why = outcome.map_or_else(|e| e.to_string(), |f| f.format);
                    tracing::error!(file = %path.display(), %why,
                        "the witness file is not readable; starting without witnessed heads");
                    BTreeMap::new()
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(error) => {
                tracing::error!(file = %path.display(), %error,
                    "the witness file is not readable; starting without witnessed heads");
                BTreeMap::new()
            }
        };
        Self { path, heads }
    }

    pub fn latest(&self, peer: &str) -> Option<&SignedHead> {
        self.heads.get(peer)
    }

    /// Keeps `head` (already verified as its peer's) if it is ahead of the kept one.
    pub fn observe(&mut self, head: SignedHead) -> std::io::Result<Observation> {
        let observation = match self.heads.get(&head.keyservice_id) {
            Some(kept) if kept.records == head.records && kept.hash == head.hash => {
                Observation::Same
            }
            Some(kept) if kept.records >= head.records => Observation::Rewound {
                witnessed: kept.clone(),
            },
            _ => Observation::Advanced,
        };
        if observation == Observation::Advanced {
            let mut heads = self.heads.clone();
            heads.insert(head.keyservice_id.clone(), head);
            let file = WitnessFile {
                format: FORMAT.into(),
                heads,
            };
            let bytes = serde_json::to_vec(&file).map_err(std::io::Error::other)?;
            crate::checkpoint::write_atomically(&self.path, &bytes)?;
            self.heads = file.heads;
        }
        Ok(observation)
    }
}

/// Verifies `head` against the configured peer it names and keeps it; what happened, or why it
/// was not a peer's head.
pub fn observe(service: &KeyService, head: SignedHead) -> Result<Observation, ApiError> {
    let peers = service.peers.as_deref().map_or(&[][..], |p| &p.list[..]);
    let Some(peer) = peers.iter().find(|p| p.id == head.keyservice_id) else {
        return Err(ApiError::Forbidden(format!(
            "{:?} is not a peer of key service {}",
            head.keyservice_id, service.id
        )));
    };
    if !head_is_signed_by(&head, &peer.id, &peer.verifying_key) {
        return Err(ApiError::Forbidden(format!(
            "the head is not signed by peer {}'s key",
            peer.id
        )));
    }
    let id = head.keyservice_id.clone();
    let observed = service
        .witnesses
        .lock()
        .map_err(|_| ApiError::Internal("witness store poisoned".into()))?
        .observe(head.clone())
        .map_err(|e| ApiError::Internal(format!("the witness file cannot be written: {e}")))?;
    if let Observation::Rewound { witnessed } = &observed {
        metrics::counter!("confed_keyservice_peer_rewinds_seen_total", "peer" => id.clone())
            .increment(1);
        tracing::error!(
            peer = %id, shown_records = head.records, shown_hash = %head.hash,
            witnessed_records = witnessed.records, witnessed_hash = %witnessed.hash,
            "a peer's audit log is behind what this service witnessed of it: it lost records \
             (a rollback or a restore), unless its operator acknowledged the loss"
        );
    }
    Ok(observed)
}

/// `POST /v1/audit/witness`: a peer's signed head; answers the latest head of that peer this
/// service witnessed (after keeping this one if it is ahead).
pub async fn accept(
    State(service): State<KeyService>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<SignedHead>, ApiError> {
    let head: SignedHead = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "the body is not a signed head ({{keyservice_id, records, hash, signature}}): {e}"
        ))
    })?;
    let id = head.keyservice_id.clone();
    observe(&service, head)?;
    latest_of(&service, &id)?
        .map(Json)
        .ok_or_else(|| ApiError::Internal("a kept head is missing".into()))
}

/// `GET /v1/audit/witnessed/{keyservice_id}`: the latest head of that key service this service
/// witnessed; 404 when none.
pub async fn witnessed(
    State(service): State<KeyService>,
    ApiPath(of): ApiPath<String>,
) -> Result<Json<SignedHead>, ApiError> {
    latest_of(&service, &of)?.map(Json).ok_or_else(|| {
        ApiError::NotFound(format!(
            "key service {} has witnessed no head of {of:?}",
            service.id
        ))
    })
}

fn latest_of(service: &KeyService, of: &str) -> Result<Option<SignedHead>, ApiError> {
    Ok(service
        .witnesses
        .lock()
        .map_err(|_| ApiError::Internal("witness store poisoned".into()))?
        .latest(of)
        .cloned())
}

/// Pulls every peer's head once and keeps those ahead; returns how many peers answered.
pub async fn pull_once(service: &KeyService, peers: &Peers) -> usize {
    let mut answered = 0;
    for peer in &peers.list {
        match peers.head(peer).await {
            Ok(head) if head.keyservice_id == peer.id => match observe(service, head) {
                Ok(_) => answered += 1,
                Err(error) => {
                    tracing::warn!(peer = %peer.id, %error, "a peer's head was not kept")
                }
            },
            Ok(head) => tracing::warn!(peer = %peer.id, named = %head.keyservice_id,
                "a peer answered another key service's head"),
            Err(error) => {
                tracing::debug!(peer = %peer.id, %error, "a peer's head is not reachable")
            }
        }
    }
    answered
}

/// Pushes this service's head to every peer once; each answer (what the peer witnessed of this
/// service) is judged like a start-up answer (`rollback::judge_answer`).
pub async fn push_once(service: &KeyService, peers: &Peers) {
    let Ok(head) = service.audit.lock().map(|g| g.0.signed_head(&service.id)) else {
        return;
    };
    for peer in &peers.list {
        match peers.push(peer, &head).await {
            Ok(answer) => {
                crate::rollback::judge_answer(service, &peer.id, answer).await;
            }
            Err(error) => {
                tracing::debug!(peer = %peer.id, %error, "a peer did not take this service's head")
            }
        }
    }
}

/// Runs for the life of the service: pushes the head whenever a record is appended, pulls the
/// peers' heads every `interval`.
pub async fn run(service: KeyService, peers: std::sync::Arc<Peers>, interval: std::time::Duration) {
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => { pull_once(&service, &peers).await; }
            _ = service.head_changed.notified() => push_once(&service, &peers).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(id: &str, records: u64, hash: char) -> SignedHead {
        SignedHead {
            keyservice_id: id.into(),
            records,
            hash: hash.to_string().repeat(64),
            signature: Some("s".into()),
        }
    }

    #[test]
    fn a_kept_head_moves_forward_only_and_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("audit.jsonl");
        let mut store = WitnessStore::open(&log);
        assert_eq!(
            store.observe(head("ks2", 5, 'a')).unwrap(),
            Observation::Advanced
        );
        assert_eq!(
            store.observe(head("ks2", 5, 'a')).unwrap(),
            Observation::Same
        );
        assert_eq!(
            store.observe(head("ks2", 3, 'b')).unwrap(),
            Observation::Rewound {
                witnessed: head("ks2", 5, 'a')
            },
            "behind: a rollback"
        );
        assert!(
            matches!(
                store.observe(head("ks2", 5, 'c')).unwrap(),
                Observation::Rewound { .. }
            ),
            "another hash at the same length: a fork"
        );
        assert_eq!(
            store.observe(head("ks3", 1, 'd')).unwrap(),
            Observation::Advanced
        );
        let reopened = WitnessStore::open(&log);
        assert_eq!(reopened.latest("ks2"), Some(&head("ks2", 5, 'a')));
        assert_eq!(reopened.latest("ks3"), Some(&head("ks3", 1, 'd')));
    }

    #[test]
    fn an_unreadable_witness_file_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("audit.jsonl");
        std::fs::write(path_for(&log), b"{not json").unwrap();
        assert!(WitnessStore::open(&log).latest("ks2").is_none());
    }
}
