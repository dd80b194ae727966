//! HTTP client for the task assignment API.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use thiserror::Error;

use confed_protocol::device::{
    AssignmentResponse, Attributes, CheckinRequest, ReportOutcome, ReportRequest, ReportResponse,
    RetryResponse,
};
use confed_protocol::envelope::EnvelopeError;
use confed_protocol::hpke::{PublicKey, RustCrypto, Sealer};
use confed_protocol::keys::{DeviceKey, KeyState};
use confed_protocol::policy::{DeviceLimits, Evaluation, TaskPolicy, sha256_hex};
use confed_protocol::trust::{
    TrustConfig, TrustError, TrustFileError, TrustedIssuer, TrustedKeyService, accept_device_key,
};

use crate::state::{DeviceState, FileStore, StateError, StateStore};

#[derive(Debug, Error)]
pub enum DeviceError {
    #[error("cannot read the device trust file {path}")]
    TrustFileRead {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("the device trust file {path} is not valid")]
    TrustFileParse {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("device trust file: {0}")]
    TrustFile(#[from] TrustFileError),
    /// The request's URL is stripped (`without_url`): it may carry the capability or a signed
    /// upload URL, and error text travels into logs and reports.
    #[error("network")]
    Network(#[source] reqwest::Error),
    #[error("the server URL {0:?} is not an http:// or https:// URL (e.g. http://127.0.0.1:8080)")]
    ServerUrl(String),
    #[error("the server answered 304 Not Modified for a model this device has not cached")]
    UncachedNotModified,
    #[error("server answered {status}: {detail}")]
    Server { status: u16, detail: String },
    #[error("refusing to encrypt")]
    UntrustedKey(#[from] TrustError),
    #[error("refusing the task policy: {0}")]
    UntrustedPolicy(String),
    #[error("training: {0}")]
    Training(String),
    #[error(
        "this device already sealed an update for round {round} of task {task_id} (or cannot tell)"
    )]
    AlreadySealed { task_id: String, round: i64 },
    #[error(
        "this device served round {served} of task {task_id}; its policy keeps a device's rounds at least {min_separation} apart, so round {round} must wait"
    )]
    TooSoon {
        task_id: String,
        round: i64,
        served: i64,
        min_separation: u32,
    },
    #[error("sealing")]
    Seal(#[from] EnvelopeError),
    #[error("the model cannot be trained from")]
    Model(#[from] crate::update::ModelShapeError),
    #[error("device state")]
    State(#[from] StateError),
    #[error("device token: {0}")]
    Token(String),
}

/// Why a device that sealed for the rounds in `done` must not serve `round` of `task_id` under a
/// minimum separation of `separation` rounds (1: only the same round is refused).
fn too_close(
    done: &BTreeSet<(String, i64)>,
    task_id: &str,
    round: i64,
    separation: u32,
) -> Option<DeviceError> {
    let served = done
        .iter()
        .filter(|(task, served)| task == task_id && served.abs_diff(round) < u64::from(separation))
        .map(|(_, served)| *served)
        .min_by_key(|served| served.abs_diff(round))?;
    Some(if served == round {
        DeviceError::AlreadySealed {
            task_id: task_id.to_string(),
            round,
        }
    } else {
        DeviceError::TooSoon {
            task_id: task_id.to_string(),
            round,
            served,
            min_separation: separation,
        }
    })
}

/// Reads a device trust file (JSON, `docs/protocol.md` "The device trust file").
pub fn load_trust(path: &std::path::Path) -> Result<TrustConfig, DeviceError> {
    let shown = || path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| DeviceError::TrustFileRead {
        path: shown(),
        source,
    })?;
    let trust: TrustConfig =
        serde_json::from_str(&text).map_err(|source| DeviceError::TrustFileParse {
            path: shown(),
            source,
        })?;
    trust.check()?;
    Ok(trust)
}

impl From<reqwest::Error> for DeviceError {
    fn from(error: reqwest::Error) -> Self {
        Self::Network(error.without_url())
    }
}

impl DeviceError {
    /// The error and its causes on one line (`network: connection refused: ...`), for logs and
    /// tools that show errors without `anyhow`.
    pub fn with_causes(&self) -> String {
        confed_protocol::errors::with_causes(self)
    }
}

/// The answer to a check-in.
#[derive(Debug)]
pub enum Checkin {
    Assigned(Box<AssignmentResponse>),
    Retry(RetryResponse),
}

/// How many times an idempotent call is tried in all, after network errors or 5xx answers.
const ATTEMPTS: u32 = 4;

/// After failed attempt number `attempt` (from 1): waits before the next one (200 ms, doubling),
/// or gives up with `failure` once all `ATTEMPTS` are spent.
async fn retry_or_give_up(attempt: u32, failure: DeviceError) -> Result<(), DeviceError> {
    if attempt >= ATTEMPTS {
        return Err(failure);
    }
    tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
    Ok(())
}

/// Key entries (exact content) whose signatures were already checked. Checking two or more ECDSA
/// signatures costs more than the rest of a device cycle, and the answer for the same bytes never
/// changes, so a device checks each key entry once; simulated devices may share one cache.
#[derive(Debug, Clone, Default)]
pub struct VerifiedKeys(std::sync::Arc<Mutex<HashMap<String, PublicKey>>>);

impl VerifiedKeys {
    fn fingerprint(key: &DeviceKey) -> String {
        serde_json::to_string(key).unwrap_or_default()
    }
}

#[derive(Debug)]
pub struct DeviceClient {
    pub(crate) http: reqwest::Client,
    base: String,
    trusted: Vec<TrustedKeyService>,
    threshold: usize,
    limits: DeviceLimits,
    tenant_id: Option<String>,
    /// (task, model version) -> (ETag, bytes, SHA-256 computed here: the server's ETag is not
    /// trusted). Keyed by the model, not the URL: each assignment has its own model URL.
    models: Mutex<HashMap<String, CachedModel>>,
    /// The rounds this device served, the DP-FTRL tasks among them and the on-demand
    /// evaluations it granted (`state::DeviceState`): what only it knows.
    state: Mutex<DeviceState>,
    /// Where `state` is kept across restarts; `None`: memory only (`with_state`, `open`).
    store: Option<Arc<dyn StateStore>>,
    /// Whether check-ins tell the server the rounds served (`served`); off, the device declines
    /// instead and its check-ins stay unlinkable to its earlier assignments.
    send_served: bool,
    verified: VerifiedKeys,
    sealer: std::sync::Arc<dyn Sealer>,
    /// The token issuers of the trust file, and how this device attests to them (`tokens.rs`):
    /// without an attestation it declines tasks that require device tokens.
    pub(crate) token_issuers: Vec<TrustedIssuer>,
    pub(crate) attestation: Option<Arc<dyn crate::tokens::Attestation>>,
    pub(crate) token_sources: Mutex<HashMap<String, Arc<crate::tokens::TokenSource>>>,
    /// The trust file, for a masked policy's check (`TrustConfig::accept_masking`): every key
    /// service it names listed, with its verifying key, and masking required if the file says.
    trust_file: TrustConfig,
}

type CachedModel = (String, std::sync::Arc<Vec<u8>>, String);

/// A model version as the device trains from it.
#[derive(Debug, Clone)]
pub struct Model {
    pub bytes: std::sync::Arc<Vec<u8>>,
    /// Lowercase hex SHA-256 of `bytes`, computed by the device.
    pub sha256: String,
}

impl Model {
    /// The shape every update to this model has under `policy` (`UpdateShape::well_formed`
    /// makes one: the model's tensors, the health flag when the policy names `health`, the
    /// example count when it names `weighting`), or
    /// why the model cannot be trained from (a fault of the model, the same for every device).
    pub fn update_shape(
        &self,
        policy: &AcceptedPolicy,
    ) -> Result<crate::update::UpdateShape, DeviceError> {
        Ok(crate::update::UpdateShape::of_model(&self.bytes)?
            .reporting_health(policy.health())
            .weighing(policy.weighting()))
    }
}

/// A task policy the device accepted: parsed, this assignment's, within its limits.
#[derive(Debug, Clone)]
pub struct AcceptedPolicy {
    pub policy: TaskPolicy,
    pub sha256: String,
}

impl AcceptedPolicy {
    /// Whether the policy names the health signal: then every update carries the flag
    /// `HEALTH_TENSOR` (docs/protocol.md, "Health").
    pub fn health(&self) -> bool {
        self.policy
            .dp_mechanism()
            .is_ok_and(|mechanism| mechanism.health.is_some())
    }

    /// The example-weighted averaging the policy names, if any: then every update carries the
    /// example count `EXAMPLES_TENSOR` (docs/protocol.md, "Weighting").
    pub fn weighting(&self) -> Option<confed_protocol::policy::Weighting> {
        self.policy
            .dp_mechanism()
            .ok()
            .and_then(|mechanism| mechanism.weighting)
    }

    /// The evaluation the policy schedules for the assignment's round, if it is a scheduled
    /// evaluation round: the device then measures the model it downloaded (the version the round
    /// trains from) on its own held-out examples and adds `[loss_sum, correct, examples]` to its
    /// update as the F32 `[3]` tensor `EVALUATION_TENSOR` (docs/protocol.md, "Evaluation"). In a
    /// round that does not evaluate that tensor makes the enclave refuse the whole update.
    /// `DeviceClient::evaluation_for` also grants on-demand evaluations.
    pub fn evaluation_in(&self, assignment: &AssignmentResponse) -> Option<Evaluation> {
        let round = u64::try_from(assignment.round).ok()?;
        self.policy
            .dp_mechanism()
            .ok()?
            .evaluation
            .filter(|e| e.evaluates(round))
    }
}

pub(crate) async fn problem_detail(response: reqwest::Response) -> DeviceError {
    let status = response.status().as_u16();
    let text = response.text().await.unwrap_or_default();
    let detail = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|p| p.get("detail").and_then(|d| d.as_str()).map(str::to_string))
        .unwrap_or(text);
    DeviceError::Server { status, detail }
}

impl DeviceClient {
    pub fn new(base: &str, trust: &TrustConfig) -> Result<Self, DeviceError> {
        Self::with_http(
            confed_protocol::http::client(Duration::from_secs(30)),
            base,
            trust,
        )
    }

    /// A device sharing an HTTP client (connection pool) with others, e.g. in a simulation. Each
    /// device keeps its own model cache and its own record of rounds it contributed to.
    pub fn with_http(
        http: reqwest::Client,
        base: &str,
        trust: &TrustConfig,
    ) -> Result<Self, DeviceError> {
        Self::with_shared(http, base, trust, VerifiedKeys::default())
    }

    /// Like `with_http`, also sharing the cache of checked key entries.
    pub fn with_shared(
        http: reqwest::Client,
        base: &str,
        trust: &TrustConfig,
        verified: VerifiedKeys,
    ) -> Result<Self, DeviceError> {
        // Refused here, not at the first request: reqwest's "builder error" names no URL.
        let parsed = reqwest::Url::parse(base).map_err(|_| DeviceError::ServerUrl(base.into()))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(DeviceError::ServerUrl(base.into()));
        }
        Ok(Self {
            http,
            base: base.trim_end_matches('/').to_string(),
            trusted: trust.trusted()?,
            threshold: trust.threshold,
            limits: trust.limits,
            tenant_id: trust.tenant_id.clone(),
            models: Mutex::default(),
            state: Mutex::default(),
            store: None,
            send_served: true,
            verified,
            sealer: std::sync::Arc::new(RustCrypto),
            token_issuers: trust.token_issuers.clone(),
            attestation: None,
            token_sources: Mutex::default(),
            trust_file: trust.clone(),
        })
    }

    /// A device over `base` that keeps its state in the file `state_file` (created if missing):
    /// what a real device should use.
    pub fn open(
        base: &str,
        trust: &TrustConfig,
        state_file: &std::path::Path,
    ) -> Result<Self, DeviceError> {
        Self::new(base, trust)?.with_state(Arc::new(FileStore::new(state_file)))
    }

    /// Keeps the rounds served and the on-demand evaluations granted in `store`: what it holds
    /// is loaded (added to anything already given) and saved back at once, so a store that
    /// cannot be written fails here, not at the first seal. Without a store the device keeps
    /// them in memory only and says so on its first seal: a restarted device would forget the
    /// rounds it served and could serve rounds its policies' accounting forbids.
    pub fn with_state(mut self, store: Arc<dyn StateStore>) -> Result<Self, DeviceError> {
        let loaded = store.load()?;
        {
            let state = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
            if let Some(loaded) = loaded {
                state.merge(loaded);
            }
            store.save(state)?;
        }
        self.store = Some(store);
        Ok(self)
    }

    /// The device's state, locked (a poisoned lock still holds the record: it must not be lost).
    fn state(&self) -> std::sync::MutexGuard<'_, DeviceState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Saves `state` to the store, if there is one; warns once per process if there is none.
    fn persist(&self, state: &DeviceState) -> Result<(), StateError> {
        match &self.store {
            Some(store) => store.save(state),
            None => {
                static WARNED: std::sync::Once = std::sync::Once::new();
                WARNED.call_once(|| {
                    tracing::warn!(
                        "this device keeps the rounds it served in memory only (no state store: DeviceClient::open or with_state); restarted, it forgets them and may serve rounds its task policies' privacy accounting forbids"
                    );
                });
                Ok(())
            }
        }
    }

    /// Seals with another HPKE implementation (e.g. AWS-LC's in a load generator); the default
    /// is the protocol's pure-Rust one.
    pub fn with_sealer(mut self, sealer: std::sync::Arc<dyn Sealer>) -> Self {
        self.sealer = sealer;
        self
    }

    /// A path on the server, or an absolute URL as given (a blob store's signed upload URL).
    fn url(&self, path: &str) -> String {
        if path.starts_with("https://") || path.starts_with("http://") {
            path.to_string()
        } else {
            format!("{}{path}", self.base)
        }
    }

    pub async fn checkin(
        &self,
        population: &str,
        client_version: &str,
        attributes: &Attributes,
    ) -> Result<Checkin, DeviceError> {
        let response = self
            .http
            .post(self.url(&format!("/v1/populations/{population}/checkin")))
            .json(&CheckinRequest {
                client_version: client_version.to_string(),
                attributes: attributes.clone(),
                tenant_id: self.tenant_id.clone(),
                served: self.latest_served(population),
            })
            .send()
            .await?;
        match response.status().as_u16() {
            201 => Ok(Checkin::Assigned(Box::new(response.json().await?))),
            200 => Ok(Checkin::Retry(response.json().await?)),
            _ => Err(problem_detail(response).await),
        }
    }

    /// The (task, round) pairs this device sealed an update for: what it must keep across restarts
    /// (`with_served` gives them back), since it is the only party that knows them.
    pub fn served(&self) -> Vec<(String, i64)> {
        self.state().served.iter().cloned().collect()
    }

    /// Check-ins without `served` (the device declines instead; see `latest_served`).
    pub fn without_served_hints(mut self) -> Self {
        self.send_served = false;
        self
    }

    /// What a check-in into `population` tells the server so it does not assign rounds this
    /// device would decline: the latest round served of each tree task of that population that
    /// still has a round within its separation (at most `MAX_SERVED`). Gaussian tasks need no
    /// hint (the same round's re-attempt is declined), and every entry links this check-in to an
    /// earlier assignment, so nothing more is sent.
    fn latest_served(&self, population: &str) -> Vec<confed_protocol::device::ServedRound> {
        if !self.send_served {
            return Vec::new();
        }
        let state = self.state().clone();
        let separated = &state.separated;
        let mut latest: HashMap<String, i64> = HashMap::new();
        for (task, round) in state.served {
            let Some((task_population, separation, rounds)) = separated.get(&task) else {
                continue;
            };
            if task_population != population || *separation <= 1 || round >= i64::from(*rounds) {
                continue;
            }
            let entry = latest.entry(task).or_insert(round);
            *entry = (*entry).max(round);
        }
        let mut out: Vec<_> = latest
            .into_iter()
            .map(|(task_id, round)| confed_protocol::device::ServedRound { task_id, round })
            .collect();
        out.sort_by(|a, b| {
            b.round
                .cmp(&a.round)
                .then_with(|| a.task_id.cmp(&b.task_id))
        });
        out.truncate(confed_protocol::device::MAX_SERVED);
        out
    }

    /// The client with the rounds a previous run of this device served (from `served`).
    pub fn with_served(self, served: impl IntoIterator<Item = (String, i64)>) -> Self {
        self.state().served.extend(served);
        self
    }

    /// The evaluation this assignment asks of the device, if any: a round the policy's schedule
    /// evaluates, or one the partner asked to evaluate on demand (`assignment.evaluate`, the
    /// server's word) while this device has granted fewer than the policy's `on_demand` of the
    /// task. An on-demand one is counted when granted, whether or not the caller then sends the
    /// metrics: this count is what bounds the device's privacy cost, so keep it across restarts
    /// (`on_demand_evaluated`, `with_on_demand_evaluated`). The caller adds `[loss_sum, correct,
    /// examples]` of the downloaded model to its update as the F32 `[3]` tensor
    /// `EVALUATION_TENSOR`.
    pub fn evaluation_for(
        &self,
        assignment: &AssignmentResponse,
        policy: &AcceptedPolicy,
    ) -> Option<Evaluation> {
        if let Some(scheduled) = policy.evaluation_in(assignment) {
            return Some(scheduled);
        }
        let evaluation = policy.policy.dp_mechanism().ok()?.evaluation?;
        if !assignment.evaluate
            || evaluation.on_demand == 0
            || policy.policy.task_id != assignment.task_id
        {
            return None;
        }
        let mut state = self.state();
        let key = (assignment.task_id.clone(), assignment.round);
        if state.on_demand.contains(&key) {
            return Some(evaluation);
        }
        let of_task = state.on_demand.iter().filter(|(t, _)| *t == key.0).count();
        if of_task >= evaluation.on_demand as usize {
            return None;
        }
        state.on_demand.insert(key.clone());
        // Granted only once kept: a device that could not record the grant sends no metrics
        // (and forgets the grant, so asking again does not find it granted).
        match self.persist(&state) {
            Ok(()) => Some(evaluation),
            Err(_) => {
                state.on_demand.remove(&key);
                None
            }
        }
    }

    /// The (task, round) on-demand evaluations this device granted: keep them across restarts.
    pub fn on_demand_evaluated(&self) -> Vec<(String, i64)> {
        self.state().on_demand.iter().cloned().collect()
    }

    /// The client with the on-demand evaluations a previous run granted.
    pub fn with_on_demand_evaluated(
        self,
        granted: impl IntoIterator<Item = (String, i64)>,
    ) -> Self {
        self.state().on_demand.extend(granted);
        self
    }

    /// Whether this device must decline the assignment: it already contributed to the round (the
    /// privacy unit is one contribution per round), or, under a tree mechanism (DP-FTRL), it
    /// served a round of the task fewer than the policy's `min_separation` rounds before or
    /// after this one. The accounting counts on this: the device is the only party that knows
    /// which rounds it served, so it enforces the separation itself (`seal` refuses too).
    pub fn declines(&self, assignment: &AssignmentResponse) -> Option<DeviceError> {
        let separation = TaskPolicy::parse(&assignment.policy)
            .ok()
            .and_then(|p| p.mechanism().ok())
            .map_or(1, |m| m.min_separation());
        too_close(
            &self.state().served,
            &assignment.task_id,
            assignment.round,
            separation,
        )
    }

    /// The X25519 key to seal to, if at least T trusted key services signed it and it is valid
    /// now. Signatures over an entry are checked once; validity is checked every time.
    pub fn verified_key(
        &self,
        assignment: &AssignmentResponse,
        now: i64,
    ) -> Result<PublicKey, DeviceError> {
        let key = &assignment.encryption;
        let fingerprint = VerifiedKeys::fingerprint(key);
        let cached = self
            .verified
            .0
            .lock()
            .ok()
            .and_then(|c| c.get(&fingerprint).copied());
        let active = KeyState::at(key.not_before, key.not_after, now) == KeyState::Active;
        if let Some(public) = cached
            && active
        {
            return Ok(public);
        }
        let public = accept_device_key(key, &self.trusted, self.threshold, now)?;
        if let Ok(mut cache) = self.verified.0.lock() {
            cache.insert(fingerprint, public);
        }
        Ok(public)
    }

    /// The assignment's model and its SHA-256, from the cache when the server answers 304.
    pub async fn model(&self, assignment: &AssignmentResponse) -> Result<Model, DeviceError> {
        let identity = format!("{}/{}", assignment.task_id, assignment.model_version);
        let cached = self
            .models
            .lock()
            .ok()
            .and_then(|m| m.get(&identity).cloned());
        let mut request = self.http.get(self.url(&assignment.model_url));
        if let Some((etag, _, _)) = &cached {
            request = request.header(reqwest::header::IF_NONE_MATCH, etag);
        }
        let response = request.send().await?;
        match response.status().as_u16() {
            304 => cached
                .map(|(_, bytes, sha256)| Model { bytes, sha256 })
                .ok_or(DeviceError::UncachedNotModified),
            200 => {
                let etag = response
                    .headers()
                    .get(reqwest::header::ETAG)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_string);
                let bytes = std::sync::Arc::new(response.bytes().await?.to_vec());
                let sha256 = sha256_hex(&bytes);
                if let (Some(etag), Ok(mut models)) = (etag, self.models.lock()) {
                    models.insert(identity, (etag, bytes.clone(), sha256.clone()));
                }
                Ok(Model { bytes, sha256 })
            }
            _ => Err(problem_detail(response).await),
        }
    }

    /// The assignment's task policy, if it parses, is this task's and population's, and lies
    /// within the device's limits (and the enclave's). Refused otherwise, with why: a device
    /// never seals under a policy it did not check.
    pub fn accepted_policy(
        &self,
        assignment: &AssignmentResponse,
        population: &str,
    ) -> Result<AcceptedPolicy, DeviceError> {
        let refuse = |why: String| DeviceError::UntrustedPolicy(why);
        let policy = TaskPolicy::parse(&assignment.policy).map_err(|e| refuse(e.to_string()))?;
        if policy.task_id != assignment.task_id || policy.population != population {
            return Err(refuse(format!(
                "the policy is for task {} in population {}, the assignment for task {} in {population}",
                policy.task_id, policy.population, assignment.task_id
            )));
        }
        if let Some(pinned) = &self.tenant_id
            && &policy.tenant_id != pinned
        {
            return Err(refuse(format!(
                "the policy is tenant {}'s; this device works only for tenant {pinned}",
                policy.tenant_id
            )));
        }
        if confed_protocol::ids::wire_round(assignment.round)
            .is_none_or(|round| round > u64::from(policy.rounds))
        {
            return Err(refuse(format!(
                "round {} is outside the policy's {} rounds",
                assignment.round, policy.rounds
            )));
        }
        self.limits
            .check(&policy)
            .map_err(|e| refuse(e.to_string()))?;
        confed_protocol::trust::accept_device_auth(&self.token_issuers, &policy)
            .map_err(|e| refuse(e.to_string()))?;
        // A masked task's masking keys, each signed by the key service this device lists under
        // its id (and a task in the clear refused if the trust file requires masking).
        self.trust_file
            .accept_masking(&policy)
            .map_err(|e| refuse(e.to_string()))?;
        if policy.device_auth.is_some() && self.attestation.is_none() {
            return Err(refuse(
                "the task requires device tokens and this device has no attestation to obtain them (DeviceClient::with_attestation)".into(),
            ));
        }
        let sha256 = sha256_hex(assignment.policy.as_bytes());
        Ok(AcceptedPolicy { policy, sha256 })
    }

    /// Uploads the envelope; retried on network errors and 5xx (the server answers 200 for the same
    /// bytes again, so a retry after a lost answer is safe).
    pub async fn upload(
        &self,
        assignment: &AssignmentResponse,
        envelope: Vec<u8>,
    ) -> Result<(), DeviceError> {
        let mut attempt = 0;
        loop {
            let mut request = self.http.put(self.url(&assignment.upload_url));
            if assignment.upload_headers.is_empty() {
                request = request.header(reqwest::header::CONTENT_TYPE, "application/cbor");
            }
            for (name, value) in &assignment.upload_headers {
                request = request.header(name, value);
            }
            let sent = request.body(envelope.clone()).send().await;
            // A blob store's create-only precondition answers 412 when an earlier attempt's
            // bytes arrived but its answer was lost; the report checks what is stored.
            let direct_again = |status: reqwest::StatusCode| {
                status == reqwest::StatusCode::PRECONDITION_FAILED
                    && assignment.upload_url.contains("://")
            };
            let failure = match sent {
                Ok(response)
                    if response.status().is_success() || direct_again(response.status()) =>
                {
                    self.state()
                        .served
                        .insert((assignment.task_id.clone(), assignment.round));
                    return Ok(());
                }
                Ok(response) if response.status().is_server_error() => {
                    problem_detail(response).await
                }
                Ok(response) => return Err(problem_detail(response).await),
                Err(e) => DeviceError::from(e),
            };
            attempt += 1;
            retry_or_give_up(attempt, failure).await?;
        }
    }

    /// Reports the outcome (idempotent: retried like uploads).
    pub async fn report(
        &self,
        assignment: &AssignmentResponse,
        outcome: ReportOutcome,
        error: Option<&str>,
    ) -> Result<ReportResponse, DeviceError> {
        let body = ReportRequest {
            outcome,
            error: error.map(str::to_string),
        };
        let mut attempt = 0;
        loop {
            let failure = match self
                .http
                .post(self.url(&assignment.report_url))
                .json(&body)
                .send()
                .await
            {
                Ok(response) if response.status().is_success() => {
                    self.forget_schedule(assignment);
                    return Ok(response.json().await?);
                }
                Ok(response) if response.status().is_server_error() => {
                    problem_detail(response).await
                }
                Ok(response) => return Err(problem_detail(response).await),
                Err(e) => DeviceError::from(e),
            };
            attempt += 1;
            retry_or_give_up(attempt, failure).await?;
        }
    }
}

mod send;
#[cfg(test)]
mod tests;
