//! Tasks as a service, beside check-in (`checkin.rs`) and uploads (`uploads.rs`): creating a task
//! from a partner's request, listing a tenant's tasks a page at a time, a task with its recent
//! eligible check-ins, cancelling, and storing model version 0 (which opens the task). The partner
//! API (`api::tasks`, `api::models`) and the console call these and only map what they return.

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use thiserror::Error;

use crate::blob::{BlobError, BlobKey, BlobStore};
use crate::clock::Millis;
use crate::db::{Db, DbError, NewModel, RoundRecord, TaskCursor, TaskRecord};
use crate::registry::DeviceRegistry;
use crate::spool::Spooled;
use crate::states::TaskState;
use crate::task_spec::{CreateTaskRequest, InvalidParam};

#[derive(Debug, Error)]
pub enum TaskError {
    /// The request's fields, each with what is wrong (the privacy plan under `privacy`).
    #[error("the request has {} invalid field(s)", .0.len())]
    InvalidFields(Vec<InvalidParam>),
    #[error("`page_token` is not one this server issued; start again without it")]
    BadPageToken,
    /// The validation thread failed (a bug).
    #[error("the request could not be validated: {0}")]
    Validation(String),
    #[error(
        "task {id} is {}: model version 0 can only be uploaded while the task is CREATED",
        .state.as_str()
    )]
    NotCreated { id: String, state: TaskState },
    #[error("the body is not a usable model: {0}")]
    NotAModel(String),
    /// Reading the spooled model back failed (the server's temporary file).
    #[error("the spooled model cannot be read: {0}")]
    Spool(String),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Blob(#[from] BlobError),
}

/// One page of a tenant's tasks, newest first, and the token of the next page if there is one.
#[derive(Debug)]
pub struct Page {
    pub tasks: Vec<TaskRecord>,
    pub next_page_token: Option<String>,
}

/// The task service over the task database, the model store and the check-in registry.
pub struct Tasks<'a> {
    pub db: &'a Db,
    pub blobs: &'a dyn BlobStore,
    pub registry: &'a DeviceRegistry,
    /// The key services' signed key sets: a masked task's policy names their masking keys.
    pub keys: &'a crate::keys::directory::KeyDirectory,
}

impl Tasks<'_> {
    /// Validates `request` field by field (and its privacy plan) and creates the task, CREATED.
    pub async fn create(
        &self,
        tenant_id: &str,
        request: CreateTaskRequest,
    ) -> Result<TaskRecord, TaskError> {
        // A BLT task's matrix is optimized when the request names none: 0.1-2 s at a few
        // thousand rounds, up to about 25 s at 10,000, the first time for a shape (then cached).
        // On a blocking thread, one such validation at a time: the permit moves into the thread,
        // so a request dropped while it runs (a client that hung up, the request timeout) still
        // holds it until the work ends, and task creation never takes more than one core.
        static OPTIMIZING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);
        let permit = match request.privacy.names_blt() {
            true => Some(
                OPTIMIZING
                    .acquire()
                    .await
                    .map_err(|e| TaskError::Validation(e.to_string()))?,
            ),
            false => None,
        };
        let masked = request.secure_aggregation == Some(true);
        let distributed = request.distributed_noise == Some(true);
        if distributed && !masked {
            return Err(TaskError::InvalidFields(vec![crate::task_spec::InvalidParam {
                name: "distributed_noise".into(),
                reason: "distributed noise is drawn by the key services of a masked task: set `secure_aggregation` too".into(),
            }]));
        }
        let mut spec = tokio::task::spawn_blocking(move || {
            let _one_at_a_time = permit;
            request.validate()
        })
        .await
        .map_err(|e| TaskError::Validation(e.to_string()))?
        .map_err(TaskError::InvalidFields)?;
        if masked {
            spec.masking = Some(self.masking_line(tenant_id, &spec, distributed)?);
        }
        let analytics = spec.analytics.is_some();
        let task = self.db.create_task(tenant_id, &spec).await?;
        if !analytics {
            return Ok(task);
        }
        // An analytics task has no model to wait for: its fixed version 0 opens it now.
        let model = confed_worker_api::model::analytics_model();
        let digest = confed_protocol::hex::sha256_hex(&model);
        let key = BlobKey::model(tenant_id, &task.id, 0, &digest)?;
        self.blobs.put(&key, &model).await?;
        let record = NewModel {
            blob_key: key.as_str().to_string(),
            sha256_hex: digest,
            size_bytes: model.len() as i64,
            optimizer_state_key: None,
        };
        Ok(self
            .db
            .open_task_with_model(tenant_id, &task.id, &record)
            .await?)
    }

    /// A masked task's policy line: every key service of the current key, with its signed
    /// masking key, in the order of their ids; refused, naming the field, if a key service
    /// publishes none or the task uses what masking does not mask yet (the enclave's own check
    /// of the policy text).
    fn masking_line(
        &self,
        tenant_id: &str,
        spec: &crate::task_spec::TaskSpec,
        distributed: bool,
    ) -> Result<String, TaskError> {
        let refuse_field = |name: &str, reason: String| {
            TaskError::InvalidFields(vec![crate::task_spec::InvalidParam {
                name: name.into(),
                reason,
            }])
        };
        let refuse = |reason: String| refuse_field("secure_aggregation", reason);
        // The key services agree to and sum at most this many inputs a round.
        let most = spec.most_devices_per_round();
        let limit = confed_attestation::unmask_api::MAX_UNMASK_INPUTS as u64;
        if most > limit {
            let over = spec
                .over_selection
                .max(crate::task_spec::ADAPTIVE_OVER_SELECTION_CAP);
            return Err(refuse(format!(
                "the key services unmask at most {limit} inputs of a masked round, and this task's rounds can assign {most} devices (report_goal x (1 + max(over_selection, {}))): set report_goal to at most {}",
                crate::task_spec::ADAPTIVE_OVER_SELECTION_CAP,
                (limit as f64 / (1.0 + over)).floor() as u64
            )));
        }
        let now = self.db.now().0 / 1000;
        let mut masking = self.keys.masking_policy(now).map_err(refuse)?;
        if distributed {
            let variance = distributed_variance(&spec.policy("checked-before-creation", tenant_id))
                .map_err(|reason| refuse_field("distributed_noise", reason))?;
            masking = masking
                .with_noise(variance)
                .map_err(|reason| refuse_field("distributed_noise", reason))?;
        }
        let ring = ring_for(spec, &masking);
        masking = masking.with_ring(ring);
        let mut checked = spec.clone();
        checked.masking = Some(masking.encode());
        checked
            .policy("checked-before-creation", tenant_id)
            .check_enclave_limits()
            .map_err(|e| refuse(e.to_string()))?;
        Ok(masking.encode())
    }

    /// At most `limit` of the tenant's tasks after `page_token` (a token `page` gave).
    pub async fn page(
        &self,
        tenant_id: &str,
        limit: u32,
        page_token: Option<&str>,
    ) -> Result<Page, TaskError> {
        let cursor = page_token.map(decode_cursor).transpose()?;
        // One extra row tells whether another page follows.
        let mut tasks = self
            .db
            .list_tasks(tenant_id, limit + 1, cursor.as_ref())
            .await?;
        let next_page_token = if tasks.len() > limit as usize {
            tasks.truncate(limit as usize);
            tasks.last().map(encode_cursor)
        } else {
            None
        };
        Ok(Page {
            tasks,
            next_page_token,
        })
    }

    /// The task and the check-ins of the last 15 minutes that would fit it.
    pub async fn with_eligible(
        &self,
        tenant_id: &str,
        id: &str,
        now: Millis,
    ) -> Result<(TaskRecord, u64), TaskError> {
        let task = self.db.task(tenant_id, id).await?;
        let eligible = self.registry.eligible(&task.spec, now);
        Ok((task, eligible))
    }

    pub async fn cancel(&self, tenant_id: &str, id: &str) -> Result<TaskRecord, TaskError> {
        Ok(self.db.cancel_task(tenant_id, id).await?)
    }

    pub async fn rounds(&self, tenant_id: &str, id: &str) -> Result<Vec<RoundRecord>, TaskError> {
        Ok(self.db.rounds(tenant_id, id).await?)
    }

    /// Refuses before the body is read when the task cannot take model version 0.
    pub async fn check_open_for_model(&self, tenant_id: &str, id: &str) -> Result<(), TaskError> {
        check_created(&self.db.task(tenant_id, id).await?)
    }

    /// Validates and stores model version 0 of a CREATED task, which opens it (round 1 starts).
    /// The model is read through a map of its spooled file, never whole in memory.
    pub async fn store_version_zero(
        &self,
        tenant_id: &str,
        id: &str,
        spooled: Spooled,
    ) -> Result<TaskRecord, TaskError> {
        let task = self.db.task(tenant_id, id).await?;
        check_created(&task)?;
        // A BLT task's rounds refuse a model with more values than its policy's max_values
        // (what the rounding is charged for): refused now, not at round 1.
        let max_values = match task.spec.privacy.mechanism() {
            confed_protocol::policy::Mechanism::Blt(blt) => Some(blt.max_values),
            _ => None,
        };
        let spooled = std::sync::Arc::new(spooled);
        let checked = spooled.clone();
        tokio::task::spawn_blocking(move || {
            let mapped = checked.map().map_err(|e| TaskError::Spool(e.to_string()))?;
            let schema = confed_worker_api::model::validate_model(&mapped)
                .map_err(|e| TaskError::NotAModel(e.to_string()))?;
            match max_values {
                Some(most) if schema.parameter_count() as u64 > most => {
                    Err(TaskError::NotAModel(format!(
                        "it has {} values, more than the task's BLT max_values {most}; create the task with a larger privacy.blt.max_values",
                        schema.parameter_count()
                    )))
                }
                _ => Ok(()),
            }
        })
        .await
        .map_err(|e| TaskError::Spool(e.to_string()))??;
        let digest = spooled.sha256_hex.clone();
        let key = BlobKey::model(tenant_id, id, 0, &digest)?;
        self.blobs.put_file(&key, spooled.file()).await?;
        let model = NewModel {
            blob_key: key.as_str().to_string(),
            sha256_hex: digest,
            size_bytes: spooled.len as i64,
            optimizer_state_key: None,
        };
        Ok(self.db.open_task_with_model(tenant_id, id, &model).await?)
    }
}

fn check_created(task: &TaskRecord) -> Result<(), TaskError> {
    // Its version 0 is the fixed stand-in stored when it was created (even if that failed
    // half way and left it CREATED): nobody else's model may take its place.
    if task.spec.analytics.is_some() {
        return Err(TaskError::NotAModel(
            "an analytics task has no model to upload: its version 0 is fixed (docs/api.md, \"Analytics tasks\")".into(),
        ));
    }
    if task.state != TaskState::Created {
        return Err(TaskError::NotCreated {
            id: task.id.clone(),
            state: task.state,
        });
    }
    Ok(())
}

/// A page token: the last task's creation time and id, base64url (opaque to partners).
fn encode_cursor(task: &TaskRecord) -> String {
    URL_SAFE_NO_PAD.encode(format!("{}:{}", task.created_at, task.id))
}

fn decode_cursor(token: &str) -> Result<TaskCursor, TaskError> {
    let text = URL_SAFE_NO_PAD
        .decode(token)
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
        .ok_or(TaskError::BadPageToken)?;
    let (created_at, id) = text.split_once(':').ok_or(TaskError::BadPageToken)?;
    Ok(TaskCursor {
        created_at: created_at.parse().map_err(|_| TaskError::BadPageToken)?,
        id: id.to_string(),
    })
}

/// The ring a masked task's masks live in: 2^32 (half the bytes on the wire, for devices and key
/// services alike) when the sum of the most devices a round can assign
/// (`most_devices_per_round`: the report goal with over-selection at its cap), with the
/// distributed noise's bound, stays below 2^31; else 2^64. The enclave refuses, before it asks
/// for the key, a round whose contributions do not fit.
fn ring_for(
    spec: &crate::task_spec::TaskSpec,
    masking: &confed_protocol::masking_keys::MaskingPolicy,
) -> confed_protocol::masking::Ring {
    use confed_protocol::masking::{Ring, noise_value_bound};
    let noise = masking.noise_variance.map_or(0.0, |variance| {
        noise_value_bound(variance, masking.layout().groups().len())
    });
    let units = confed_protocol::grid::GRID_UNITS_PER_CLIP as u64;
    match Ring::Bits32.holds(spec.most_devices_per_round(), units, noise) {
        true => Ring::Bits32,
        false => Ring::Bits64,
    }
}

/// The per-group variance of a masked task's distributed noise (grid units squared): the
/// variance the budget calibrates, by the front end's closed form, raised by one part in 10^4
/// so that the enclave's own calibration (OpenDP's, held within 10^-9 of it by the enclave's
/// tests) never finds it short; the key services check it with the closed form itself.
fn distributed_variance(policy: &confed_protocol::policy::TaskPolicy) -> Result<u64, String> {
    let mechanism = policy.dp_mechanism().map_err(|e| e.to_string())?;
    if mechanism.noise != confed_protocol::mechanism::Mechanism::Gaussian {
        return Err(format!(
            "distributed noise is per-round Gaussian noise; the mechanism {} correlates its noise across rounds, which only the enclave can draw",
            mechanism.noise.encode()
        ));
    }
    let scale = confed_dp::calibrated_scale(
        &confed_dp::ClosedForm,
        mechanism,
        policy.epsilon,
        policy.delta,
        policy.rounds,
    )
    .map_err(|e| e.to_string())?;
    let variance = (scale * scale * (1.0 + 1e-4)).ceil();
    if !(variance.is_finite() && variance >= 1.0) {
        return Err(format!("the budget calibrates no usable noise ({scale})"));
    }
    // Saturates above 2^64; `with_noise` refuses anything above its range.
    Ok(variance as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_token_names_the_last_task_and_a_foreign_one_is_refused() {
        let token = URL_SAFE_NO_PAD.encode("1700000000000:0193abcd");
        let cursor = decode_cursor(&token).unwrap();
        assert_eq!(
            (cursor.created_at, cursor.id.as_str()),
            (1_700_000_000_000, "0193abcd")
        );
        for foreign in [
            "",
            "!!",
            &URL_SAFE_NO_PAD.encode("no-colon"),
            &URL_SAFE_NO_PAD.encode("x:1"),
        ] {
            assert!(
                matches!(decode_cursor(foreign), Err(TaskError::BadPageToken)),
                "{foreign}"
            );
        }
    }
}
