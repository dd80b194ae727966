//! Rollback detection across key services (docs/attestation.md, "Rollback across key services").
//!
//! A key service's own checkpoint catches a log that lost records while the checkpoint stayed;
//! a restore of the whole directory from an older copy (log and checkpoint together) passes it.
//! What the restored copy cannot take back is what peers witnessed: every peer keeps the latest
//! head of this service it saw (`witness.rs`), signed with this service's key. After a start this
//! service grants nothing until a quorum of peers told it what they witnessed of it, and grants
//! nothing at all once any peer shows a head its log does not contain, until the operator
//! restores the newer log or acknowledges the loss, which is itself a signed audit record
//! (`acknowledge.rs`).
//!
//! Why a lost or compromised peer cannot stop an honest service forever: a head counts only if
//! this service's own key signed it, so no peer can invent a loss; a peer that does not answer (or
//! answers junk) counts as down, and the start quorum is ceil(p/2) of p peers, which every member
//! of a release quorum reaches whenever that quorum is up (`peers::default_quorum`).

use std::collections::BTreeSet;
use std::io::BufRead;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use crate::KeyService;
use crate::audit::SignedHead;
use crate::error::KeyServiceApiError as ApiError;
use crate::peers::{Peers, head_is_signed_by};

/// Whether this service grants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GateState {
    Open,
    /// Started with peers; waiting for `needed` of them to say what they witnessed.
    Waiting {
        answered: BTreeSet<String>,
        needed: usize,
    },
    /// A peer witnessed a head this log does not contain.
    RolledBack {
        detail: String,
    },
}

#[derive(Debug)]
pub struct GrantGate(Mutex<GateState>);

impl GrantGate {
    pub fn open() -> Self {
        Self(Mutex::new(GateState::Open))
    }

    pub fn waiting_for(needed: usize) -> Self {
        if needed == 0 {
            return Self::open();
        }
        Self(Mutex::new(GateState::Waiting {
            answered: BTreeSet::new(),
            needed,
        }))
    }

    pub fn state(&self) -> GateState {
        self.0.lock().map_or_else(
            |_| GateState::RolledBack {
                detail: "the grant gate is poisoned".into(),
            },
            |s| s.clone(),
        )
    }

    /// Refuses a release while the gate is not open.
    pub fn check(&self) -> Result<(), ApiError> {
        match self.state() {
            GateState::Open => Ok(()),
            GateState::Waiting { answered, needed } => Err(ApiError::Unavailable(format!(
                "this key service has just started and grants nothing until {needed} of its peers \
                 said what they witnessed of its audit log ({} so far); retry shortly",
                answered.len()
            ))),
            GateState::RolledBack { detail } => Err(ApiError::RolledBack(detail)),
        }
    }

    fn answered(&self, peer: &str) {
        if let Ok(mut state) = self.0.lock()
            && let GateState::Waiting { answered, needed } = &mut *state
        {
            answered.insert(peer.to_string());
            if answered.len() >= *needed {
                *state = GateState::Open;
                tracing::info!("enough peers answered; granting");
            }
        }
    }

    fn rolled_back(&self, detail: String) {
        if let Ok(mut state) = self.0.lock()
            && !matches!(*state, GateState::RolledBack { .. })
        {
            *state = GateState::RolledBack { detail };
            metrics::gauge!("confed_keyservice_rolled_back").set(1.0);
        }
    }
}

/// What a peer's witnessed head of this service says about this service's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The log contains the head.
    Consistent,
    /// The log does not contain it, but the operator acknowledged losing exactly this head.
    Acknowledged,
    /// Not this service's signed head: it proves nothing (the peer counts as not answering).
    Unusable(String),
    /// The log does not contain a head this service signed: records are gone.
    Behind(String),
}

/// Judges `witnessed` against this service's log as it is now.
pub async fn judge(service: &KeyService, witnessed: &SignedHead) -> Verdict {
    if !head_is_signed_by(witnessed, &service.id, service.signing_key.verifying_key()) {
        return Verdict::Unusable(format!(
            "the head is not signed by key service {}'s own key",
            service.id
        ));
    }
    if witnessed.records == 0 {
        return Verdict::Consistent;
    }
    let lost = crate::audit::LostHead {
        records: witnessed.records,
        hash: witnessed.hash.clone(),
    };
    let Ok((own, path, acknowledged)) = service.audit.lock().map(|g| {
        (
            g.0.head().clone(),
            g.0.path().to_path_buf(),
            g.1.acknowledged(&lost),
        )
    }) else {
        return Verdict::Unusable("the audit log is poisoned".into());
    };
    let at = witnessed.records - 1;
    let ours = if witnessed.records == own.records {
        Ok(Some(own.hash.clone()))
    } else if witnessed.records < own.records {
        // Records below the head are never rewritten: read without the lock.
        tokio::task::spawn_blocking(move || hash_at(&path, at))
            .await
            .unwrap_or_else(|e| Err(std::io::Error::other(e)))
    } else {
        Ok(None)
    };
    let ours = match ours {
        Ok(ours) => ours,
        Err(e) => return Verdict::Unusable(format!("the audit log cannot be read: {e}")),
    };
    if ours.as_deref() == Some(witnessed.hash.as_str()) {
        return Verdict::Consistent;
    }
    if acknowledged {
        return Verdict::Acknowledged;
    }
    Verdict::Behind(format!(
        "a peer witnessed this key service's audit head at {} records (hash {}), which its log ({} \
         records, head {}) does not contain: release decisions it made durable are gone (a \
         restore from an older copy, or a rollback), and its release ledger with them. It grants \
         nothing until its operator restores the newer log, or accepts the loss with the service \
         stopped: `confed keyservice audit acknowledge-loss LOG --id {} --signing-key FILE \
         --records {} --hash {} --signature={} --note WHY` (the signature is base64url and may begin with `-`, hence the `=`)",
        witnessed.records,
        witnessed.hash,
        own.records,
        own.hash,
        service.id,
        witnessed.records,
        witnessed.hash,
        witnessed.signature.as_deref().unwrap_or("none")
    ))
}

/// The hash of record `seq` of the log at `path` (`None` if the log is shorter).
pub fn hash_at(path: &Path, seq: u64) -> std::io::Result<Option<String>> {
    let mut reader = std::io::BufReader::new(std::fs::File::open(path)?);
    let mut line = Vec::new();
    for index in 0..=seq {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(None);
        }
        if index == seq {
            let record: crate::audit::Record =
                serde_json::from_slice(&line).map_err(std::io::Error::other)?;
            return Ok((record.seq == seq).then_some(record.hash));
        }
    }
    Ok(None)
}

/// Acts on what `peer` answered it witnessed of this service (`None`: nothing). Returns whether
/// the answer counts toward the start quorum.
pub async fn judge_answer(service: &KeyService, peer: &str, answer: Option<SignedHead>) -> bool {
    let verdict = match &answer {
        None => Verdict::Consistent,
        Some(witnessed) => judge(service, witnessed).await,
    };
    match verdict {
        Verdict::Consistent => {}
        Verdict::Acknowledged => tracing::info!(%peer,
            "a peer witnessed a head of this service that the operator acknowledged as lost"),
        Verdict::Unusable(why) => {
            tracing::warn!(%peer, %why, "a peer's answer about this service's audit head proves nothing");
            return false;
        }
        Verdict::Behind(detail) => {
            tracing::error!(%peer, %detail, "audit log rolled back: granting nothing");
            service.gate.rolled_back(format!("peer {peer}: {detail}"));
        }
    }
    service.gate.answered(peer);
    true
}

/// Asks each peer in `pending` once what it witnessed of this service; returns the peers still
/// to ask (unreachable, or an answer that proved nothing).
pub async fn ask_once<'a>(
    service: &KeyService,
    peers: &'a Peers,
    pending: Vec<&'a crate::peers::Peer>,
) -> Vec<&'a crate::peers::Peer> {
    let mut left = Vec::new();
    for peer in pending {
        let counted = match peers.witnessed(peer, &service.id).await {
            Ok(answer) => judge_answer(service, &peer.id, answer).await,
            Err(error) => {
                tracing::warn!(peer = %peer.id, %error, "a peer did not answer what it witnessed");
                false
            }
        };
        if !counted {
            left.push(peer);
        }
    }
    left
}

/// Runs after a start: asks every peer until each has answered (backing off to 30 s between
/// rounds of asking). The gate opens as soon as the quorum answered; a later answer can still
/// close it for good.
pub async fn ask_until_answered(service: KeyService, peers: std::sync::Arc<Peers>) {
    let mut pending: Vec<_> = peers.list.iter().collect();
    let mut delay = Duration::from_secs(1);
    loop {
        pending = ask_once(&service, &peers, pending).await;
        if pending.is_empty() {
            return;
        }
        tokio::time::sleep(delay).await;
        delay = (delay * 2).min(Duration::from_secs(30));
    }
}
