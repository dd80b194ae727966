//! Witnessing peers' audit heads: each key service keeps, durably, the latest signed audit head it
//! has seen of each configured peer, and answers a peer that asks what it witnessed of it
//! (`rollback.rs` is the asking side).
//!
//! Heads arrive two ways: a peer pushes its head after each record it appends
//! (`POST /v1/audit/witness`), and this service pulls every peer's head periodically
//! (`GET /v1/audit/head`), which covers pushes lost while either side was down. A head is kept
//! only if its peer's key signed it and it **extends** the one kept: this service fetches the
//! records between the two (`GET /v1/audit/records`), a page at a time and at most
//! `MAX_RECORDS_PER_ADVANCE` a call, and checks that they chain from the kept head to the new
//! one; a peer further ahead is followed over several pulls (`follow`). One verification of a
//! peer runs at a time (`Following`), and each peer has its own push and pull task (`run`). A restored log that grew past the kept head on another history is a
//! fork: not kept, so the kept head keeps showing the loss. The one way off a kept head that is
//! not extended: the peer's log holds a signed `loss_acknowledged` record naming exactly that
//! head, and the new head extends that record. A head behind the kept one, or another hash at
//! its length, means the peer lost records: counted, never stored (logged loudly on pulls; a
//! push of an old head is anyone's replay). The file is written at most once per advance.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use axum::Json;
use axum::extract::State;

use crate::KeyService;
use crate::audit::SignedHead;
use crate::error::KeyServiceApiError as ApiError;
use crate::extract::{ApiBytes, ApiPath};
use crate::peers::{Acknowledgement, Peers, Records, Witnessed, head_is_signed_by};

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
    /// Ahead of the kept one, but not on its history (and no acknowledgement of the kept head
    /// leads to it), or its records could not be fetched: not kept.
    Unverified { witnessed: SignedHead, why: String },
    /// Further ahead than one call verifies (`MAX_RECORDS_PER_ADVANCE`): kept as far as its
    /// records were verified (a signed record of the peer's); the next pull goes on.
    Following { kept: SignedHead },
    /// Another head of this peer is being verified right now: this one is left for the next
    /// pull (one verification per peer at a time bounds what a flood of pushes costs).
    Busy,
}

/// The latest head of each peer, kept in `<audit log>.witnessed.json`.
#[derive(Debug)]
pub struct WitnessStore {
    path: PathBuf,
    heads: BTreeMap<String, SignedHead>,
    /// Peers whose records are being fetched and verified now.
    following: std::collections::BTreeSet<String>,
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
                    let aside = PathBuf::from(format!("{}.unreadable", path.display()));
                    let moved = std::fs::rename(&path, &aside);
                    tracing::error!(file = %path.display(), aside = %aside.display(), %why,
                        moved = moved.is_ok(),
                        "the witness file is not readable; set aside, starting without witnessed heads");
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
        Self {
            path,
            heads,
            following: Default::default(),
        }
    }

    /// Claims the one verification of `peer`'s records that may run at a time; false if another
    /// runs (`finish_following`, called when the claim is dropped, gives it back).
    pub fn start_following(&mut self, peer: &str) -> bool {
        self.following.insert(peer.to_string())
    }

    pub fn finish_following(&mut self, peer: &str) {
        self.following.remove(peer);
    }

    pub fn latest(&self, peer: &str) -> Option<&SignedHead> {
        self.heads.get(peer)
    }

    /// What `head` (already verified as its peer's) is to the kept one: `Advanced` means it is
    /// ahead (or the first) and still has to be shown to extend the kept one before `keep`.
    pub fn classify(&self, head: &SignedHead) -> Observation {
        match self.heads.get(&head.keyservice_id) {
            Some(kept) if kept.records == head.records && kept.hash == head.hash => {
                Observation::Same
            }
            Some(kept) if kept.records >= head.records => Observation::Rewound {
                witnessed: kept.clone(),
            },
            _ => Observation::Advanced,
        }
    }

    /// Keeps `head` as its peer's latest even if it is behind the kept one: for a peer whose
    /// signed acknowledgement of losing the kept head was verified (`witness::replace`).
    pub fn replace(&mut self, head: SignedHead) -> std::io::Result<()> {
        self.write_with(head)
    }

    fn write_with(&mut self, head: SignedHead) -> std::io::Result<()> {
        let mut heads = self.heads.clone();
        heads.insert(head.keyservice_id.clone(), head);
        let file = WitnessFile {
            format: FORMAT.into(),
            heads,
        };
        let bytes = serde_json::to_vec(&file).map_err(std::io::Error::other)?;
        crate::checkpoint::write_atomically(&self.path, &bytes)?;
        self.heads = file.heads;
        Ok(())
    }

    /// Keeps `head` as its peer's latest (durably: the file is replaced atomically).
    /// Two heads of one peer verified at once (a push and a pull) must not leave the older one
    /// kept: a head not ahead of the one kept by now is not written.
    pub fn keep(&mut self, head: SignedHead) -> std::io::Result<()> {
        if self
            .heads
            .get(&head.keyservice_id)
            .is_some_and(|kept| kept.records >= head.records)
        {
            return Ok(());
        }
        self.write_with(head)
    }
}

/// How a head reached this service.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Via {
    /// Pushed by whoever sent it (possibly a replay of an old head).
    Push,
    /// Pulled from the peer itself.
    Pull,
}

/// Verifies `head` against the configured peer it names and keeps it if it extends the kept
/// one; what happened, or why it was not a peer's head.
pub async fn observe(
    service: &KeyService,
    head: SignedHead,
    via: Via,
) -> Result<Observation, ApiError> {
    let peers = service.peers.clone();
    let Some(peer) = peers
        .as_deref()
        .and_then(|p| p.list.iter().find(|p| p.id == head.keyservice_id))
    else {
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
    let (observed, kept) = {
        let store = service
            .witnesses
            .lock()
            .map_err(|_| ApiError::Internal("witness store poisoned".into()))?;
        (store.classify(&head), store.latest(&peer.id).cloned())
    };
    let observed = match (observed, kept) {
        (Observation::Advanced, None) => {
            // The first head of a peer is taken as it is.
            store(service, head.clone(), Store::Forward).await?;
            Observation::Advanced
        }
        (Observation::Advanced, Some(kept)) => {
            let Some(_claim) = Following::claim(service, &peer.id)? else {
                return Ok(Observation::Busy);
            };
            let peers = peers.as_deref().expect("a peer was found above");
            match extends(peers, peer, &kept, &head).await {
                Ok(reached) if reached == head => {
                    store(service, head.clone(), Store::Forward).await?;
                    Observation::Advanced
                }
                Ok(reached) => {
                    store(service, reached.clone(), Store::Forward).await?;
                    Observation::Following { kept: reached }
                }
                Err(why) => Observation::Unverified {
                    witnessed: kept,
                    why,
                },
            }
        }
        (Observation::Rewound { witnessed }, _) => {
            // A peer that lost records may have acknowledged the loss (a signed record naming
            // exactly the kept head): its new history, however short, starts there and is
            // followed, instead of alarming at every pull for good.
            let Some(_claim) = Following::claim(service, &peer.id)? else {
                return Ok(Observation::Busy);
            };
            let peers = peers.as_deref().expect("a peer was found above");
            match after_acknowledged_loss(peers, peer, &witnessed, &head).await {
                Ok(reached) => {
                    store(service, reached.clone(), Store::Replacing).await?;
                    if reached == head {
                        Observation::Advanced
                    } else {
                        Observation::Following { kept: reached }
                    }
                }
                Err(_) => Observation::Rewound { witnessed },
            }
        }
        (other, _) => other,
    };
    let loud = via == Via::Pull;
    match &observed {
        Observation::Rewound { witnessed } if loud => {
            metrics::counter!("confed_keyservice_peer_rewinds_seen_total", "peer" => peer.id.clone())
                .increment(1);
            tracing::error!(
                peer = %peer.id, shown_records = head.records, shown_hash = %head.hash,
                witnessed_records = witnessed.records, witnessed_hash = %witnessed.hash,
                "a peer's audit log is behind what this service witnessed of it: it lost records \
                 (a rollback or a restore), unless its operator acknowledged the loss"
            );
        }
        Observation::Unverified { witnessed, why } if loud => {
            metrics::counter!("confed_keyservice_peer_rewinds_seen_total", "peer" => peer.id.clone())
                .increment(1);
            tracing::error!(
                peer = %peer.id, shown_records = head.records,
                witnessed_records = witnessed.records, witnessed_hash = %witnessed.hash, %why,
                "a peer's head does not extend what this service witnessed of it: kept the \
                 witnessed head"
            );
        }
        Observation::Rewound { .. } | Observation::Unverified { .. } => {
            tracing::debug!(peer = %peer.id, ?observed, "a pushed head was not kept")
        }
        _ => {}
    }
    Ok(observed)
}

/// Whether `head` extends `kept` in `peer`'s log: the records between chain from one to the
/// other, or (after an acknowledged loss) from the peer's signed acknowledgement of `kept`. The
/// furthest signed head verified on the way (`head` itself once the records reach it).
async fn extends(
    peers: &Peers,
    peer: &crate::peers::Peer,
    kept: &SignedHead,
    head: &SignedHead,
) -> Result<SignedHead, String> {
    let direct = follow(peers, peer, kept, head).await;
    let Err(why) = direct else {
        return direct;
    };
    after_acknowledged_loss(peers, peer, kept, head)
        .await
        .map_err(|ack| format!("{why}; {ack}"))
}

/// Whether `head` continues `peer`'s history from its signed acknowledgement of losing `kept`
/// (a `loss_acknowledged` record naming exactly that head): the furthest signed head verified
/// from the acknowledgement towards `head` (`head` itself once reached).
async fn after_acknowledged_loss(
    peers: &Peers,
    peer: &crate::peers::Peer,
    kept: &SignedHead,
    head: &SignedHead,
) -> Result<SignedHead, String> {
    let lost = crate::audit::LostHead {
        records: kept.records,
        hash: kept.hash.clone(),
    };
    let Some(acknowledgement) = peers.acknowledgement(peer, &lost).await.ok().flatten() else {
        return Err("the peer acknowledged no loss of the kept head".into());
    };
    let from = crate::audit::head_of(&peer.id, &acknowledgement);
    let signed = acknowledgement.decision.acknowledged_loss.as_ref() == Some(&lost)
        && head_is_signed_by(&from, &peer.id, &peer.verifying_key);
    if !signed {
        return Err("its acknowledgement of the kept head is not valid".into());
    }
    tracing::info!(peer = %peer.id, "a peer acknowledged the loss of the head kept of it");
    if from.records == head.records && from.hash == head.hash {
        return Ok(head.clone());
    }
    if from.records >= head.records {
        return Err("the head is behind the peer's acknowledgement of the kept head".into());
    }
    // Past the acknowledgement the new history is followed like any other; the acknowledgement
    // itself is a signed head to keep if the records after it take more than one call.
    Ok(follow(peers, peer, &from, head).await.unwrap_or(from))
}

/// Follows `peer`'s log from `from` towards `to`, one page of records (`GET /v1/audit/records`,
/// at most 1 MB) in memory at a time and at most `MAX_RECORDS_PER_ADVANCE` records a call:
/// every record must chain onto the one before and hash to its content. Returns `to` once the
/// records reach it with its hash, else the furthest page end whose record the peer signed (so
/// a peer of any distance is followed over several pulls); an error if the records leave the
/// history or nothing could be verified.
async fn follow(
    peers: &Peers,
    peer: &crate::peers::Peer,
    from: &SignedHead,
    to: &SignedHead,
) -> Result<SignedHead, String> {
    if to.records <= from.records {
        return Err("the head is behind the record it should extend".into());
    }
    let budget = from.records + crate::peers::MAX_RECORDS_PER_ADVANCE as u64;
    let (mut seq, mut hash) = (from.records, from.hash.clone());
    let mut reached: Option<SignedHead> = None;
    while seq < to.records && seq < budget {
        let page = peers.records(peer, seq).await?;
        if page.is_empty() {
            break;
        }
        let wanted = usize::try_from(to.records.min(budget) - seq).unwrap_or(usize::MAX);
        let mut last = None;
        for record in page.into_iter().take(wanted) {
            if record.seq != seq {
                return Err(format!("record {} where {seq} was expected", record.seq));
            }
            if record.prev_hash != hash {
                return Err(format!(
                    "record {seq} does not chain onto the witnessed history: another history"
                ));
            }
            if !crate::audit::hash_matches(&record) {
                return Err(format!("record {seq}'s hash is not its content's"));
            }
            seq += 1;
            hash.clone_from(&record.hash);
            last = Some(record);
        }
        // One signature a page: the page's last record, if the peer signed it.
        if let Some(record) = last {
            let point = crate::audit::head_of(&peer.id, &record);
            if head_is_signed_by(&point, &peer.id, &peer.verifying_key) {
                reached = Some(point);
            }
        }
    }
    if seq == to.records {
        return if hash == to.hash {
            Ok(to.clone())
        } else {
            Err("the records end at the head's length with another hash: another history".into())
        };
    }
    reached.ok_or_else(|| {
        format!(
            "{} records since the kept head, none of them verified as the peer's",
            to.records - from.records
        )
    })
}

/// The claim on one peer's verification, given back when dropped.
struct Following {
    service: KeyService,
    peer: String,
}

impl Following {
    fn claim(service: &KeyService, peer: &str) -> Result<Option<Self>, ApiError> {
        let claimed = service
            .witnesses
            .lock()
            .map_err(|_| ApiError::Internal("witness store poisoned".into()))?
            .start_following(peer);
        Ok(claimed.then(|| Self {
            service: service.clone(),
            peer: peer.to_string(),
        }))
    }
}

impl Drop for Following {
    fn drop(&mut self) {
        if let Ok(mut store) = self.service.witnesses.lock() {
            store.finish_following(&self.peer);
        }
    }
}

/// How a verified head is stored.
#[derive(Clone, Copy)]
enum Store {
    /// Only if ahead of the kept one (`WitnessStore::keep`).
    Forward,
    /// Even when behind: only after the peer's signed acknowledgement of losing the kept head
    /// (`after_acknowledged_loss`, `WitnessStore::replace`).
    Replacing,
}

async fn store(service: &KeyService, head: SignedHead, how: Store) -> Result<(), ApiError> {
    let witnesses = service.witnesses.clone();
    tokio::task::spawn_blocking(move || {
        let mut store = witnesses
            .lock()
            .map_err(|_| ApiError::Internal("witness store poisoned".into()))?;
        match how {
            Store::Forward => store.keep(head),
            Store::Replacing => store.replace(head),
        }
        .map_err(|e| ApiError::Internal(format!("the witness file cannot be written: {e}")))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?
}

/// `POST /v1/audit/witness`: a peer's signed head; answers the latest head of that peer this
/// service witnessed (after keeping this one if it extends the kept one).
pub async fn accept(
    State(service): State<KeyService>,
    ApiBytes(body): ApiBytes,
) -> Result<Json<Witnessed>, ApiError> {
    let head: SignedHead = serde_json::from_slice(&body).map_err(|e| {
        ApiError::BadRequest(format!(
            "the body is not a signed head ({{keyservice_id, records, hash, signature}}): {e}"
        ))
    })?;
    let id = head.keyservice_id.clone();
    observe(&service, head, Via::Push).await?;
    Ok(Json(Witnessed {
        witnessed: latest_of(&service, &id)?,
        keyservice_id: id,
    }))
}

/// `GET /v1/audit/witnessed/{keyservice_id}`: the latest head of that key service this service
/// witnessed (`witnessed: null` when none).
pub async fn witnessed(
    State(service): State<KeyService>,
    ApiPath(of): ApiPath<String>,
) -> Result<Json<Witnessed>, ApiError> {
    Ok(Json(Witnessed {
        witnessed: latest_of(&service, &of)?,
        keyservice_id: of,
    }))
}

fn latest_of(service: &KeyService, of: &str) -> Result<Option<SignedHead>, ApiError> {
    Ok(service
        .witnesses
        .lock()
        .map_err(|_| ApiError::Internal("witness store poisoned".into()))?
        .latest(of)
        .cloned())
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecordsQuery {
    from: u64,
}

/// `GET /v1/audit/records?from=K`: this service's records `K..`, at most
/// `MAX_RECORDS_PER_ANSWER` (what a witness checks a new head against).
pub async fn records(
    State(service): State<KeyService>,
    query: Result<axum::extract::Query<RecordsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Json<Records>, ApiError> {
    let axum::extract::Query(RecordsQuery { from }) =
        query.map_err(|e| ApiError::BadRequest(format!("send ?from=<record number>: {e}")))?;
    let (path, hint, records) = {
        let guard = service
            .audit
            .lock()
            .map_err(|_| ApiError::Internal("audit log poisoned".into()))?;
        (
            guard.0.path().to_path_buf(),
            guard.0.offset_hint(from),
            guard.0.head().records,
        )
    };
    if from >= records {
        return Ok(Json(Records {
            records: Vec::new(),
        }));
    }
    // A request for records this process did not append reads the log from its start: anyone
    // can ask, so one such scan runs at a time and the others are told to come back.
    static SCANS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
    let _scan = match hint {
        (0, 0) => Some(SCANS.try_acquire().map_err(|_| {
            ApiError::Unavailable("another peer's read of older records is in progress".into())
        })?),
        _ => None,
    };
    let max = crate::peers::MAX_RECORDS_PER_ANSWER.min((records - from) as usize);
    let read =
        tokio::task::spawn_blocking(move || crate::audit::read_records(&path, hint, from, max))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?
            .map_err(|e| ApiError::Internal(format!("reading the audit log: {e}")))?;
    Ok(Json(Records { records: read }))
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcknowledgementQuery {
    records: u64,
    hash: String,
}

/// `GET /v1/audit/acknowledgement?records=R&hash=H`: this service's `loss_acknowledged` record
/// naming that head, or `null`.
pub async fn acknowledgement(
    State(service): State<KeyService>,
    query: Result<
        axum::extract::Query<AcknowledgementQuery>,
        axum::extract::rejection::QueryRejection,
    >,
) -> Result<Json<Acknowledgement>, ApiError> {
    let axum::extract::Query(AcknowledgementQuery { records, hash }) = query
        .map_err(|e| ApiError::BadRequest(format!("send ?records=<count>&hash=<hex>: {e}")))?;
    let lost = crate::audit::LostHead { records, hash };
    let index = (lost.records, lost.hash.clone());
    let indexed = || -> Result<Option<crate::audit::Record>, ApiError> {
        Ok(service
            .acknowledgements
            .lock()
            .map_err(|_| ApiError::Internal("acknowledgement index poisoned".into()))?
            .get(&index)
            .cloned())
    };
    if let Some(record) = indexed()? {
        return Ok(Json(Acknowledgement {
            record: Some(record),
        }));
    }
    // The ledger knows every acknowledged head: only those are looked up in the log, once each
    // (the record is immutable and kept in the index), and one such scan runs at a time: an
    // unauthenticated caller must not be able to start scans of the whole file at will.
    static SCANS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    let _scan = SCANS.lock().await;
    // Another request may have scanned while this one waited.
    if let Some(record) = indexed()? {
        return Ok(Json(Acknowledgement {
            record: Some(record),
        }));
    }
    let path = {
        let guard = service
            .audit
            .lock()
            .map_err(|_| ApiError::Internal("audit log poisoned".into()))?;
        if !guard.1.acknowledged(&lost) {
            return Ok(Json(Acknowledgement { record: None }));
        }
        guard.0.path().to_path_buf()
    };
    let record =
        tokio::task::spawn_blocking(move || crate::audit::find_acknowledgement(&path, &lost))
            .await
            .map_err(|e| ApiError::Internal(e.to_string()))?
            .map_err(|e| ApiError::Internal(format!("reading the audit log: {e}")))?;
    if let Some(record) = &record {
        service
            .acknowledgements
            .lock()
            .map_err(|_| ApiError::Internal("acknowledgement index poisoned".into()))?
            .insert(index, record.clone());
    }
    Ok(Json(Acknowledgement { record }))
}

/// Pulls every peer's head once and keeps those ahead; returns how many peers answered.
pub async fn pull_once(service: &KeyService, peers: &Peers) -> usize {
    let mut answered = 0;
    for peer in &peers.list {
        if pull_peer(service, peers, peer).await {
            answered += 1;
        }
    }
    answered
}

/// Pulls one peer's head and keeps it if it is ahead; whether the peer answered.
pub async fn pull_peer(service: &KeyService, peers: &Peers, peer: &crate::peers::Peer) -> bool {
    match peers.head(peer).await {
        Ok(head) if head.keyservice_id == peer.id => {
            match observe(service, head, Via::Pull).await {
                Ok(_) => true,
                Err(error) => {
                    tracing::warn!(peer = %peer.id, %error, "a peer's head was not kept");
                    false
                }
            }
        }
        Ok(head) => {
            tracing::warn!(peer = %peer.id, named = %head.keyservice_id,
                "a peer answered another key service's head");
            false
        }
        Err(error) => {
            tracing::debug!(peer = %peer.id, %error, "a peer's head is not reachable");
            false
        }
    }
}

/// Pushes this service's head to every peer once; each answer (what the peer witnessed of this
/// service) is judged like a start-up answer (`rollback::judge_answer`).
pub async fn push_once(service: &KeyService, peers: &Peers) {
    for peer in &peers.list {
        push_peer(service, peers, peer).await;
    }
}

/// Pushes this service's current head to one peer and judges its answer.
pub async fn push_peer(service: &KeyService, peers: &Peers, peer: &crate::peers::Peer) {
    let Ok(head) = service.audit.lock().map(|g| g.0.signed_head(&service.id)) else {
        tracing::error!("the audit log is poisoned: not pushing its head");
        return;
    };
    match peers.push(peer, &head).await {
        Ok(answer) => {
            crate::rollback::judge_answer(service, &peer.id, answer).await;
        }
        Err(error) => {
            tracing::debug!(peer = %peer.id, %error, "a peer did not take this service's head")
        }
    }
}

/// Runs for the life of the service: each peer has a task of its own that pushes the head
/// whenever a record is appended and pulls the peer's head every `interval`, so a slow or
/// unreachable peer (each call bounded by `PEER_TIMEOUT`) delays no other peer's pushes or
/// pulls. A head appended while a push is in flight is pushed when it ends (the latest head,
/// once: pushes of one peer never queue up).
pub async fn run(service: KeyService, peers: std::sync::Arc<Peers>, interval: std::time::Duration) {
    let wakers: Vec<std::sync::Arc<tokio::sync::Notify>> =
        peers.list.iter().map(|_| Default::default()).collect();
    let mut tasks = tokio::task::JoinSet::new();
    for (index, waker) in wakers.iter().enumerate() {
        let (service, peers, waker) = (service.clone(), peers.clone(), waker.clone());
        tasks.spawn(async move {
            let peer = &peers.list[index];
            let mut tick = tokio::time::interval(interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = tick.tick() => { pull_peer(&service, &peers, peer).await; }
                    // `notify_one` keeps one permit while this task is busy: the next head is
                    // pushed once this call ends.
                    _ = waker.notified() => push_peer(&service, &peers, peer).await,
                }
            }
        });
    }
    loop {
        service.head_changed.notified().await;
        for waker in &wakers {
            waker.notify_one();
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
        assert_eq!(store.classify(&head("ks2", 5, 'a')), Observation::Advanced);
        store.keep(head("ks2", 5, 'a')).unwrap();
        assert_eq!(store.classify(&head("ks2", 5, 'a')), Observation::Same);
        assert_eq!(
            store.classify(&head("ks2", 3, 'b')),
            Observation::Rewound {
                witnessed: head("ks2", 5, 'a')
            },
            "behind: a rollback"
        );
        assert!(
            matches!(
                store.classify(&head("ks2", 5, 'c')),
                Observation::Rewound { .. }
            ),
            "another hash at the same length: a fork"
        );
        assert_eq!(store.classify(&head("ks2", 6, 'e')), Observation::Advanced);
        store.keep(head("ks3", 1, 'd')).unwrap();
        store.keep(head("ks2", 4, 'f')).unwrap();
        assert_eq!(
            store.latest("ks2"),
            Some(&head("ks2", 5, 'a')),
            "never backwards"
        );
        let reopened = WitnessStore::open(&log);
        assert_eq!(reopened.latest("ks2"), Some(&head("ks2", 5, 'a')));
        assert_eq!(reopened.latest("ks3"), Some(&head("ks3", 1, 'd')));
    }

    #[test]
    fn an_unreadable_witness_file_is_set_aside_and_the_store_starts_empty() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("audit.jsonl");
        std::fs::write(path_for(&log), b"{not json").unwrap();
        assert!(WitnessStore::open(&log).latest("ks2").is_none());
        let aside = format!("{}.unreadable", path_for(&log).display());
        assert_eq!(std::fs::read(aside).unwrap(), b"{not json");
    }
}
