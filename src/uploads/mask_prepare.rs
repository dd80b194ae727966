//! The front end's half of prepared mask sums (docs/secure-aggregation.md, "Prepared sums"):
//! every new upload to a masked round hands its envelope's `enc`, device token and sealed
//! `seeds` to a background task, which sends them in batches to every key service
//! (`POST /v1/keys/{key_id}/unmask/prepare`) while the round collects. Each key service checks
//! and opens its seeds and adds their streams ahead, so that its sums request, after the
//! release, has only the difference between the uploads and the agreed set left to do.
//!
//! Only speed depends on it. A batch that fails, an upload the queue had no room for, a
//! restart: the key service then computes those inputs' sums in full, with the same answer. So
//! nothing here retries; what failed is counted (`confed_mask_prepare_inputs_total`) and logged
//! once per batch. Each key service the task's `masking` line names (matched by the id its key
//! set answered with at its URL) is sent what the enclave's sums request will send it about
//! each input (its own item of the seeds, every item's digest, `enc` and the token), only
//! earlier, at the moments uploads arrive, which devices draw before they touch their data; it
//! also gets uploads the enclave will exclude.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use confed_attestation::unmask_api::{
    MAX_PREPARE_INPUTS, MaskedInput, PrepareAnswer, PrepareRequest, prepare_batch_inputs,
};
use confed_protocol::masking::split_seeds;
use confed_protocol::masking_keys::MaskingPolicy;
use tokio::sync::{mpsc, watch};

use crate::blob::{BlobKey, BlobStore};
use crate::db::Db;
use crate::keys::directory::KeyDirectory;

/// Uploads waiting for a batch at most; past this an upload is not prepared (its sums are
/// computed in full).
const QUEUE: usize = 16_384;
/// Rounds whose policy and length are remembered at most (past this the map starts over).
const CACHED_ROUNDS: usize = 1_024;
/// How long a key service has for one batch (about a second of its cores' work, at most).
const TIMEOUT: Duration = Duration::from_secs(30);
/// How long a key service that did not answer is left out of the batches.
const BACKOFF: Duration = Duration::from_secs(30);
/// Most bytes of a model's safetensors header read to count its values.
const MAX_HEADER_BYTES: u64 = 16 * 1024 * 1024;

/// One new upload to a masked round, as its envelope names it.
pub struct UploadedSeeds {
    pub tenant_id: String,
    pub task_id: String,
    pub round: u64,
    /// The round's key (the route's `key_id`).
    pub key_id: String,
    /// The model version the round trains from (its values are the masked vector's length).
    pub model_version: i64,
    pub assignment_ref: String,
    pub enc: Vec<u8>,
    pub token: Vec<u8>,
    pub seeds: Vec<u8>,
}

/// The upload handlers' side: hands uploads to the background task. `Default` prepares nothing.
#[derive(Debug, Clone, Default)]
pub struct MaskPreparer {
    queue: Option<mpsc::Sender<UploadedSeeds>>,
}

impl MaskPreparer {
    /// A preparer sending to the key services at `urls`, and its task, which ends when `stop`
    /// turns true. No key services: prepares nothing.
    pub fn spawn(
        db: Db,
        blobs: Arc<dyn BlobStore>,
        (keys, urls): (KeyDirectory, Vec<String>),
        stop: watch::Receiver<bool>,
    ) -> (Self, Option<tokio::task::JoinHandle<()>>) {
        if urls.is_empty() {
            return (Self::default(), None);
        }
        let (queue, uploads) = mpsc::channel(QUEUE);
        let batches = Batches {
            db,
            blobs,
            keys,
            urls,
            client: confed_protocol::http::client(TIMEOUT),
            rounds: HashMap::new(),
            unreachable: HashMap::new(),
            warned: Default::default(),
        };
        let task = tokio::spawn(batches.run(uploads, stop));
        (Self { queue: Some(queue) }, Some(task))
    }

    /// Whether uploads are prepared at all (key services to send them to).
    pub fn is_on(&self) -> bool {
        self.queue.is_some()
    }

    /// Queues `upload` for the next batch, or counts it as not prepared when the queue is full
    /// (or its task has stopped: said once in the log).
    pub fn offer(&self, upload: UploadedSeeds) {
        let Some(queue) = &self.queue else {
            return;
        };
        match queue.try_send(upload) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => count("queue_full", 1),
            Err(mpsc::error::TrySendError::Closed(_)) => {
                static SAID: std::sync::Once = std::sync::Once::new();
                SAID.call_once(|| {
                    tracing::warn!("the task that hands masked uploads to the key services has stopped: masked rounds' sums are computed in full after the release until this process restarts");
                });
                count("stopped", 1);
            }
        }
    }
}

/// Which round a batch is for: a prepare request is per task, round, key and model.
type RoundId = (String, String, u64, String, i64);

/// What a round's prepare requests carry besides inputs, and whom they go to.
#[derive(Clone)]
struct RoundFacts {
    policy: String,
    values: u64,
    masking: MaskingPolicy,
}

struct Batches {
    db: Db,
    blobs: Arc<dyn BlobStore>,
    keys: KeyDirectory,
    urls: Vec<String>,
    client: reqwest::Client,
    rounds: HashMap<RoundId, RoundFacts>,
    /// Key services left out until then: they did not answer.
    unreachable: HashMap<String, Instant>,
    /// The (round, key service) pairs whose refusal was logged.
    warned: std::collections::HashSet<(RoundId, String)>,
}

impl Batches {
    /// Takes whatever uploads are waiting (at least one, at most a request's worth), sends them,
    /// and again: while a batch is on its way, the next one gathers.
    async fn run(
        mut self,
        mut uploads: mpsc::Receiver<UploadedSeeds>,
        mut stop: watch::Receiver<bool>,
    ) {
        loop {
            let first = tokio::select! {
                next = uploads.recv() => match next {
                    Some(upload) => upload,
                    None => return,
                },
                _ = stop.changed() => return,
            };
            let mut batch = vec![first];
            while batch.len() < MAX_PREPARE_INPUTS {
                match uploads.try_recv() {
                    Ok(upload) => batch.push(upload),
                    Err(_) => break,
                }
            }
            self.send(batch).await;
        }
    }

    async fn send(&mut self, batch: Vec<UploadedSeeds>) {
        let mut by_round: BTreeMap<RoundId, Vec<UploadedSeeds>> = BTreeMap::new();
        for upload in batch {
            let round = (
                upload.tenant_id.clone(),
                upload.task_id.clone(),
                upload.round,
                upload.key_id.clone(),
                upload.model_version,
            );
            by_round.entry(round).or_default().push(upload);
        }
        for (round, uploads) in by_round {
            let facts = match self.facts(&round).await {
                Ok(facts) => facts,
                Err(why) => {
                    tracing::warn!(task = %round.1, round = round.2, %why, "uploads not prepared at the key services: their mask sums will be computed in full");
                    count("no_round", uploads.len());
                    continue;
                }
            };
            self.send_round(&round, &facts, &uploads).await;
        }
    }

    /// `uploads` of one round to every key service its masking line names, in requests within
    /// what one prepare request may expand, each chunk to all of them at once. A key service
    /// that did not answer (or has no prepare route) is left out for `BACKOFF`; one that answers
    /// slowly slows every service's batches (speed only: the uploads queue, and past the queue
    /// their sums are computed in full).
    async fn send_round(&mut self, round: &RoundId, facts: &RoundFacts, uploads: &[UploadedSeeds]) {
        let layout = facts.masking.layout();
        let now = Instant::now();
        self.unreachable.retain(|_, until| *until > now);
        let mut targets: Vec<(&String, u8)> = self
            .urls
            .iter()
            .filter(|url| !self.unreachable.contains_key(*url))
            .filter_map(|url| {
                let id = self.keys.keyservice_at(url)?;
                Some((url, facts.masking.number_of(&id)?))
            })
            .collect();
        let mut unreachable = Vec::new();
        let mut failures: Vec<(String, String)> = Vec::new();
        let mut sent_inputs = 0;
        if targets.is_empty() {
            count("no_keyservice", uploads.len());
            return;
        }
        // An upload whose seeds do not fit the layout passed no token check: none is offered,
        // but nothing here relies on it.
        let cut: Vec<(&UploadedSeeds, Vec<&[u8]>)> = uploads
            .iter()
            .filter_map(|upload| Some((upload, split_seeds(&layout, &upload.seeds).ok()?)))
            .collect();
        count("malformed", uploads.len() - cut.len());
        let per_request = prepare_batch_inputs(facts.values, layout.groups_of(targets[0].1).len());
        let this = &*self;
        for chunk in cut.chunks(per_request) {
            let sent = futures_util::future::join_all(targets.iter().map(|&(url, number)| {
                let request = PrepareRequest {
                    task_id: round.1.clone(),
                    round: round.2,
                    policy: facts.policy.clone(),
                    values: facts.values,
                    inputs: chunk
                        .iter()
                        .map(|(upload, items)| {
                            MaskedInput::of_envelope(
                                &upload.assignment_ref,
                                &upload.enc,
                                &upload.token,
                                items,
                                number,
                            )
                        })
                        .collect(),
                };
                async move {
                    let body = serde_json::to_vec(&request).map_err(|e| e.to_string())?;
                    this.post(url, &round.3, body).await
                }
            }))
            .await;
            for ((url, number), outcome) in targets.iter().zip(sent) {
                let id = &facts.masking.services[usize::from(*number) - 1].keyservice_id;
                match outcome {
                    Ok(answer) => {
                        count_at("sent", id, (answer.prepared + answer.held) as usize);
                        count_at("refused", id, answer.refused as usize);
                    }
                    Err(why) => {
                        count_at("refused", id, chunk.len());
                        // Not answering, or without the route (not upgraded yet): left out a while.
                        if why.starts_with("unreachable") || why.starts_with("404") {
                            unreachable.push((*url).clone());
                        }
                        failures.push((id.clone(), why));
                    }
                }
            }
            targets.retain(|(url, _)| !unreachable.contains(*url));
            sent_inputs += chunk.len();
            if targets.is_empty() {
                break;
            }
        }
        count("no_keyservice", cut.len() - sent_inputs);
        for url in unreachable {
            self.unreachable.insert(url, now + BACKOFF);
        }
        // Said once per round and key service: a refused batch is worth a look (an old key
        // service, a policy it will not take), not a line per batch.
        for (id, why) in failures {
            if self.warned.len() >= CACHED_ROUNDS {
                self.warned.clear();
            }
            if self.warned.insert((round.clone(), id.clone())) {
                tracing::warn!(keyservice = %id, task = %round.1, round = round.2, %why, "a key service did not prepare a batch of this round's uploads: their mask sums will be computed in full after the release");
            }
        }
    }

    async fn post(&self, url: &str, key_id: &str, body: Vec<u8>) -> Result<PrepareAnswer, String> {
        let response = self
            .client
            .post(format!(
                "{}/v1/keys/{key_id}/unmask/prepare",
                url.trim_end_matches('/')
            ))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| format!("unreachable: {e}"))?;
        let status = response.status();
        if status.is_success() {
            return response
                .json()
                .await
                .map_err(|e| format!("not a prepare answer: {e}"));
        }
        let text = response.text().await.unwrap_or_default();
        let text: String = text.chars().take(300).collect();
        Err(format!("{}: {text}", status.as_u16()))
    }

    /// The round's policy text (as the round's job names it) and its model's values, read once
    /// per round.
    async fn facts(&mut self, round: &RoundId) -> Result<RoundFacts, String> {
        if let Some(known) = self.rounds.get(round) {
            return Ok(known.clone());
        }
        let (tenant_id, task_id, _, _, version) = round;
        let task = self
            .db
            .task(tenant_id, task_id)
            .await
            .map_err(|e| e.to_string())?;
        let model = self
            .db
            .model(tenant_id, task_id, *version)
            .await
            .map_err(|e| e.to_string())?;
        let key = BlobKey::new(model.blob_key).map_err(|e| e.to_string())?;
        let masking = task
            .spec
            .masking
            .as_deref()
            .ok_or("the task does not mask its updates")
            .map_err(str::to_string)
            .and_then(|line| {
                MaskingPolicy::parse(line)
                    .map_err(|e| format!("its masking line does not parse: {e}"))
            })?;
        let facts = RoundFacts {
            policy: task.spec.policy(task_id, tenant_id).encode(),
            values: model_values(self.blobs.as_ref(), &key).await?,
            masking,
        };
        if self.rounds.len() >= CACHED_ROUNDS {
            self.rounds.clear();
        }
        self.rounds.insert(round.clone(), facts.clone());
        Ok(facts)
    }
}

/// Counts `inputs` uploads with `outcome`, before any key service was asked.
fn count(outcome: &'static str, inputs: usize) {
    if inputs > 0 {
        metrics::counter!("confed_mask_prepare_inputs_total", "outcome" => outcome)
            .increment(inputs as u64);
    }
}

/// Counts `inputs` uploads with `outcome` at key service `id` (`sent`, `refused`).
fn count_at(outcome: &'static str, id: &str, inputs: usize) {
    if inputs > 0 {
        metrics::counter!("confed_mask_prepare_inputs_total", "outcome" => outcome, "keyservice" => id.to_string())
            .increment(inputs as u64);
    }
}

/// How many values the model at `key` holds, from its safetensors header alone: the sum of its
/// tensors' shapes' products, as the enclave counts them.
async fn model_values(blobs: &dyn BlobStore, key: &BlobKey) -> Result<u64, String> {
    let prefix = blobs
        .get_range(key, 0, 8)
        .await
        .map_err(|e| e.to_string())?;
    let header_len = prefix
        .try_into()
        .map(u64::from_le_bytes)
        .map_err(|_| "the model is shorter than a safetensors header".to_string())?;
    if header_len > MAX_HEADER_BYTES {
        return Err(format!(
            "the model's safetensors header is {header_len} bytes, over the {MAX_HEADER_BYTES} this reads to count its values"
        ));
    }
    let header = blobs
        .get_range(key, 8, header_len)
        .await
        .map_err(|e| e.to_string())?;
    header_values(&header)
}

/// The values a safetensors header's tensors hold (`__metadata__` is no tensor).
fn header_values(header: &[u8]) -> Result<u64, String> {
    let parsed: HashMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| format!("the model's header: {e}"))?;
    let mut values: u64 = 0;
    for (name, tensor) in parsed {
        if name == "__metadata__" {
            continue;
        }
        let shape = tensor
            .get("shape")
            .and_then(|s| s.as_array())
            .ok_or_else(|| format!("tensor {name} has no shape"))?;
        let count = shape.iter().try_fold(1u64, |count, dimension| {
            dimension.as_u64().and_then(|d| count.checked_mul(d))
        });
        values = count
            .and_then(|count| values.checked_add(count))
            .ok_or_else(|| format!("tensor {name}'s shape is not a count of values"))?;
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The count of a real safetensors file's values: every tensor's, not the metadata.
    #[test]
    fn a_models_values_are_counted_from_its_header() {
        let a = vec![0u8; 4 * 6];
        let b = vec![0u8; 4 * 5];
        let tensors = [
            (
                "a",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![2, 3], &a)
                    .unwrap(),
            ),
            (
                "b",
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![5], &b).unwrap(),
            ),
        ];
        let metadata = Some(HashMap::from([("note".to_string(), "x".to_string())]));
        let file = safetensors::serialize(tensors, metadata).unwrap();
        let len = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        assert_eq!(header_values(&file[8..8 + len]), Ok(11));
        assert!(header_values(br#"{"a":{"dtype":"F32"}}"#).is_err());
        assert!(header_values(b"not json").is_err());
    }
}
