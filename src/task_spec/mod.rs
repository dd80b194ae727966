//! What a partner asks for when creating a task, and its validation into a `TaskSpec`.
//! Every field is checked; every problem is reported with the field's name and allowed range, all
//! at once, so a partner fixes a request in one go.

mod analytics;
mod device_auth;
mod evaluation;
pub mod integers;
mod privacy;
mod problems;
mod upload_window;

use confed_protocol::policy::{DpMechanism, Mechanism, TaskPolicy};
use confed_worker_api::optimizer::ServerOptimizer;
use std::collections::BTreeMap;

pub use analytics::TaskKind;
pub use confed_protocol::analytics::AnalyticsQuery;
pub use confed_protocol::device::{parse_version, valid_population};
pub use device_auth::DeviceAuthSpec;
pub use evaluation::{EarlyStopping, EvaluationSpec, MAX_PATIENCE, Metric};
pub use privacy::{AdaptiveClippingSpec, MechanismName, PrivacyBudget, WeightBy, WeightingSpec};
pub use problems::InvalidParam;
use problems::Problems;
pub use upload_window::{UPLOAD_ALLOWANCE_MS, UploadWindowSpec};

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub const MAX_ROUNDS: i64 = 10_000;
pub const MAX_REPORT_GOAL: i64 = 1_000_000;
pub const MAX_OVER_SELECTION: f64 = 10.0;
pub const MIN_DEADLINE_SECONDS: i64 = 10;
pub const MAX_DEADLINE_SECONDS: i64 = 7 * 24 * 3600;
pub const MAX_ROUND_ATTEMPTS: i64 = 10;
/// The enclave's own limits: it refuses to release under a looser budget whatever the database says.
pub const MAX_EPSILON: f64 = confed_protocol::policy::MAX_TASK_EPSILON;
pub const MAX_DELTA: f64 = confed_protocol::policy::MAX_TASK_DELTA;
/// The enclave's range for the clip norm (below it the grid's unit underflows).
pub const MIN_CLIP_NORM: f64 = confed_protocol::policy::MIN_CLIP_NORM;
pub const MAX_CLIP_NORM: f64 = confed_protocol::policy::MAX_CLIP_NORM;
pub const MAX_LEARNING_RATE: f64 = 100.0;
pub const MAX_PLAN_BYTES: usize = 64 * 1024;
pub const MAX_CONSTRAINTS: usize = 32;
pub const MAX_POPULATION_LEN: usize = confed_protocol::device::MAX_POPULATION_BYTES;

/// The device attribute a task requires: an exact boolean or string, or a numeric range.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Constraint {
    Flag(bool),
    Text(String),
    Range(NumericRange),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NumericRange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max: Option<f64>,
}

/// Client versions a task accepts, as dotted numbers (`"1.4"`, `"2.0.1"`); either end optional.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VersionRange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = r"^[0-9]{1,9}(\.[0-9]{1,9}){0,3}$")]
    pub min: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = r"^[0-9]{1,9}(\.[0-9]{1,9}){0,3}$")]
    pub max: Option<String>,
}

/// Longest task name, in characters.
pub const MAX_TASK_NAME_CHARS: usize = 100;

/// `POST /v1/tasks` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTaskRequest {
    /// `training` (the default) or `analytics`: devices answer the declared `analytics` query
    /// from their records, and each round releases its noised result (docs/analytics.md).
    #[serde(default)]
    pub kind: Option<TaskKind>,
    /// An analytics task's query: `{"query": "histogram", "domain_size": N, "keys_per_device":
    /// K[, "max_value": C]}`, `{"query": "open_histogram", "max_key_bytes": L,
    /// "keys_per_device": K}` or `{"query": "quantiles", "min": A, "max": B, "ranks": [...],
    /// "values_per_device": V}` (docs/analytics.md for the caps).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub analytics: Option<AnalyticsQuery>,
    /// What the partner calls the task, shown beside its id: 1-100 characters, no control
    /// characters (optional; it is not part of the task policy).
    #[serde(default)]
    #[schema(min_length = 1, max_length = 100)]
    pub name: Option<String>,
    /// Device population this task trains on: 1-128 of `A-Z a-z 0-9 . _ -`.
    #[schema(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub population: String,
    /// Planned number of rounds, 1-10000.
    #[serde(deserialize_with = "crate::task_spec::integers::i64")]
    #[schema(minimum = 1, maximum = 10000)]
    pub rounds: i64,
    /// Reports that close a round, 1-1000000 (and at most the tenant's quota).
    #[serde(deserialize_with = "crate::task_spec::integers::i64")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub report_goal: i64,
    /// Fewest reports a round may close with at its deadline, 1..=report_goal (default report_goal).
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub min_reports: Option<i64>,
    /// Extra assignments handed out beyond the report goal, 0-10 (default 0.3).
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 10.0)]
    pub over_selection: Option<f64>,
    /// How long a round collects before its deadline, 10-604800 s (default 3600).
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 10, maximum = 604800)]
    pub round_deadline_seconds: Option<i64>,
    /// How long a device has for one assignment, 10..=round_deadline_seconds (default 600, or
    /// the round deadline when that is shorter).
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 10, maximum = 604800)]
    pub assignment_timeout_seconds: Option<i64>,
    /// Attempts per round before the task fails, 1-10 (default 3).
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 1, maximum = 10)]
    pub max_round_attempts: Option<i64>,
    #[serde(default)]
    pub client_version: Option<VersionRange>,
    /// Device attributes a device must match (at most 32; names 1-64 of a-z 0-9 _).
    #[serde(default)]
    #[schema(schema_with = constraints_schema)]
    pub constraints: BTreeMap<String, Constraint>,
    pub privacy: PrivacyBudget,
    /// FedAvg server learning rate, (0, 100] (default 1.0).
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 100.0)]
    pub server_learning_rate: Option<f64>,
    /// Handed to devices unchanged: a JSON object of at most 64 KiB (default `{}`).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub plan: Option<serde_json::Value>,
    /// How the noised average becomes the next model version, with `server_learning_rate`:
    /// `{"name": "fedavg"}` (default), `{"name": "fedavgm", "momentum": 0.9}`,
    /// `{"name": "fedadam", "beta1": 0.9, "beta2": 0.99, "tau": 0.001}` or `{"name": "fedyogi",
    /// ...}` (the same fields; each defaults as shown).
    #[serde(default)]
    #[schema(value_type = Option<Object>)]
    pub server_optimizer: Option<ServerOptimizer>,
    /// Seconds of device time one device spends on one round (download, train, seal, upload),
    /// as the partner estimates it, 1-86400 (default 60): what the tenant's compute budget
    /// counts.
    #[serde(default, deserialize_with = "crate::task_spec::integers::option_i64")]
    #[schema(minimum = 1, maximum = 86400)]
    pub device_seconds_per_round: Option<i64>,
    /// Federated evaluation every few rounds, charged to the privacy budget, with an optional
    /// early-stopping rule (docs/privacy.md, "Evaluation").
    #[serde(default)]
    pub evaluation: Option<EvaluationSpec>,
    /// Count only contributions carrying a device token of this issuer (docs/protocol.md,
    /// "Device tokens"); devices whose trust file does not list the issuer decline the task.
    #[serde(default)]
    pub device_auth: Option<DeviceAuthSpec>,
    /// When devices send, in ms after they receive an assignment: each device draws its instant
    /// uniformly in the window before it touches its data, and sends whatever is ready then
    /// (a zero update if training is still running). `end_ms` is at most the assignment
    /// timeout less 5 s (default: one to two `device_seconds_per_round`, within that).
    #[serde(default)]
    pub upload_window: Option<UploadWindowSpec>,
    /// Mask each device's update beneath the enclave (docs/secure-aggregation.md): devices clip
    /// on the grid, mask their update with seeds only the key services hold, and the enclave
    /// sees the round's sum only. Needs `device_auth`, a training task, and no adaptive
    /// clipping, evaluation, health signal or weighting; every key service must publish a
    /// masking key. Default false.
    #[serde(default)]
    pub secure_aggregation: Option<bool>,
    /// With `secure_aggregation` only: the key services add the round's noise, so the enclave
    /// never holds an un-noised sum (docs/secure-aggregation.md, "Distributed noise"). Each
    /// group of key services adds the full noise the budget calibrates, so the release carries
    /// `sqrt(groups)` times the noise of a round the enclave noises (1.7x for 2-of-3, 3.2x for
    /// 3-of-5, 5.9x for 3-of-7), and the accounting is the same. Needs per-round Gaussian noise
    /// (no DP-FTRL). Default false.
    #[serde(default)]
    pub distributed_noise: Option<bool>,
}

/// A validated task definition, as stored and as returned to the partner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TaskSpec {
    /// Training or analytics (tasks created before analytics read as training).
    #[serde(default)]
    pub kind: TaskKind,
    /// An analytics task's query.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub analytics: Option<AnalyticsQuery>,
    /// The partner's name for the task (tasks created before names, or without one: none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub population: String,
    pub rounds: u32,
    pub report_goal: u32,
    pub min_reports: u32,
    pub over_selection: f64,
    pub round_deadline_seconds: u32,
    pub assignment_timeout_seconds: u32,
    pub max_round_attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_version: Option<VersionRange>,
    #[serde(default)]
    pub constraints: BTreeMap<String, Constraint>,
    pub privacy: PrivacyBudget,
    pub server_learning_rate: f64,
    #[schema(value_type = Object)]
    pub plan: serde_json::Value,
    /// The server optimizer (tasks created before optimizers existed read as FedAvg).
    #[serde(default)]
    #[schema(value_type = Object)]
    pub server_optimizer: ServerOptimizer,
    /// The partner's estimate of one device's time for one round (tasks created before compute
    /// budgets read as the default).
    #[serde(default = "default_device_seconds")]
    pub device_seconds_per_round: u32,
    /// Federated evaluation (tasks created before it read as none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationSpec>,
    /// Device tokens (tasks created before them read as none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_auth: Option<DeviceAuthSpec>,
    /// When devices send (tasks created before upload windows read as the default,
    /// `upload_window()`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub upload_window: Option<UploadWindowSpec>,
    /// A masked task's `masking` policy line (docs/protocol.md, "Task policy"): the key
    /// services' signed masking keys, fixed when the task was created (tasks created before
    /// masking read as unmasked).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub masking: Option<String>,
}

/// The highest over-selection a task's rounds adapt up to (unless the task asks for more).
pub const ADAPTIVE_OVER_SELECTION_CAP: f64 = 1.0;

/// One device's time for one round when the partner does not say.
pub const DEFAULT_DEVICE_SECONDS_PER_ROUND: u32 = 60;

fn default_device_seconds() -> u32 {
    DEFAULT_DEVICE_SECONDS_PER_ROUND
}

impl TaskSpec {
    /// The task policy devices bind their contributions to and the enclave takes its parameters
    /// from (`confed_protocol::policy`): derived from the stored definition, which never changes
    /// after creation, so every check-in and every job of the task produce the same text.
    pub fn policy(&self, task_id: &str, tenant_id: &str) -> TaskPolicy {
        TaskPolicy {
            task_id: task_id.to_string(),
            tenant_id: tenant_id.to_string(),
            population: self.population.clone(),
            rounds: self.rounds,
            report_goal: self.report_goal,
            min_reports: self.min_reports,
            epsilon: self.privacy.epsilon,
            delta: self.privacy.delta,
            clip_norm: self.privacy.clip_norm,
            mechanism: self.dp_mechanism().encode(),
            server_learning_rate: self.server_learning_rate,
            plan: serde_json::to_string(&self.plan).unwrap_or_else(|_| "{}".into()),
            upload_window: self.upload_window().policy(),
            device_auth: self.device_auth.as_ref().and_then(DeviceAuthSpec::policy),
            masking: self
                .masking
                .as_deref()
                .and_then(|line| confed_protocol::policy::MaskingPolicy::parse(line).ok()),
            analytics: self.analytics.clone(),
        }
    }

    /// The model version round `round`'s devices are given and bind: the one before it for
    /// training, always version 0 (a fixed stand-in, `analytics_model`) for analytics.
    pub fn base_model_version(&self, round: i64) -> i64 {
        match self.analytics {
            Some(_) => 0,
            None => round - 1,
        }
    }

    /// When devices send: the stored window, or the default for tasks stored without one.
    pub fn upload_window(&self) -> UploadWindowSpec {
        self.upload_window.unwrap_or_else(|| {
            UploadWindowSpec::default_for(
                self.device_seconds_per_round,
                self.assignment_timeout_seconds,
            )
        })
    }

    /// The whole mechanism the task policy names: the noise, adaptive clipping, evaluation, the
    /// health signal and weighting.
    pub fn dp_mechanism(&self) -> DpMechanism {
        DpMechanism {
            noise: self.privacy.mechanism(),
            adaptive_clipping: self.privacy.adaptive_clipping.map(|a| a.policy()),
            evaluation: self.evaluation.map(|e| e.policy()),
            health: self.privacy.health.map(|h| h.policy()),
            weighting: self.privacy.weighting.map(|w| w.policy()),
        }
    }

    /// Device-hours the task's rounds from `first_round` on may use: every device a round can
    /// assign at the most (`most_devices_per_round`) working `device_seconds_per_round` on it.
    pub fn device_hours(&self, first_round: i64) -> f64 {
        let rounds = (i64::from(self.rounds) - first_round + 1).max(0) as f64;
        rounds * self.most_devices_per_round() as f64 * f64::from(self.device_seconds_per_round)
            / 3600.0
    }

    /// The largest capacity a round can have, adaptive over-selection at its cap.
    pub fn most_devices_per_round(&self) -> u64 {
        self.capacity_for(Some(1.0))
    }

    /// A round's capacity when the previous round lost `dropout` of its devices (failed, timed
    /// out or late): over-selection rises to what replaces that share, `1 / (1 - dropout) - 1`,
    /// never below the task's own `over_selection` and at most `ADAPTIVE_OVER_SELECTION_CAP`
    /// (or the task's own, if higher).
    pub fn capacity_for(&self, dropout: Option<f64>) -> u64 {
        let cap = self.over_selection.max(ADAPTIVE_OVER_SELECTION_CAP);
        let needed = match dropout {
            Some(d) if d < 1.0 => 1.0 / (1.0 - d) - 1.0,
            Some(_) => cap,
            None => 0.0,
        };
        let over = needed.max(self.over_selection).min(cap);
        (f64::from(self.report_goal) * (1.0 + over)).ceil() as u64
    }

    /// Most live assignments a round hands out: `ceil(report_goal * (1 + over_selection))`.
    pub fn max_live_assignments(&self) -> u64 {
        (f64::from(self.report_goal) * (1.0 + self.over_selection)).ceil() as u64
    }
}

impl CreateTaskRequest {
    /// Checks every field; on failure returns every invalid field with what is allowed.
    pub fn validate(mut self) -> Result<TaskSpec, Vec<InvalidParam>> {
        let mut p = Problems::default();
        let query = analytics::validate(&mut p, self.kind, self.analytics.as_ref());
        let is_analytics = self.kind == Some(TaskKind::Analytics) || self.analytics.is_some();
        if is_analytics {
            analytics::refuse_training_fields(&mut p, &self);
            self.privacy.clip_norm = confed_protocol::policy::ANALYTICS_CLIP_NORM;
        } else if self.privacy.clip_norm.is_nan() {
            p.add(
                "privacy.clip_norm",
                format!(
                    "a training task needs the L2 bound of one device's update, in [{MIN_CLIP_NORM}, {MAX_CLIP_NORM}]"
                ),
            );
            self.privacy.clip_norm = 1.0;
        }
        // Lengths as sent (JSON Schema's maxLength counts them so), kept without the spaces
        // around.
        let too_long = self
            .name
            .as_ref()
            .is_some_and(|n| n.chars().count() > MAX_TASK_NAME_CHARS);
        let name = self.name.map(|n| n.trim().to_string());
        if let Some(name) = &name
            && (name.is_empty() || too_long || name.chars().any(char::is_control))
        {
            p.add(
                "name",
                format!("must be 1-{MAX_TASK_NAME_CHARS} characters without control characters"),
            );
        }
        if !valid_population(&self.population) {
            p.add(
                "population",
                format!(
                    "must be 1-{MAX_POPULATION_LEN} characters of A-Z, a-z, 0-9, '.', '_', '-'"
                ),
            );
        }
        let rounds_valid = (1..=MAX_ROUNDS).contains(&self.rounds);
        let rounds = p.int("rounds", self.rounds, 1, MAX_ROUNDS);
        // A field bounded by another is checked against that field only when it is valid itself,
        // so one mistake is reported once.
        let report_goal = p.checked_int("report_goal", self.report_goal, 1, MAX_REPORT_GOAL);
        let min_reports = match self.min_reports {
            Some(v) => p.int(
                "min_reports",
                v,
                1,
                report_goal.map_or(MAX_REPORT_GOAL, i64::from),
            ),
            None => report_goal.unwrap_or(1),
        };
        let report_goal = report_goal.unwrap_or(1);
        let over_selection = p.float(
            "over_selection",
            self.over_selection.unwrap_or(0.3),
            0.0,
            false,
            MAX_OVER_SELECTION,
        );
        let round_deadline_seconds = p.checked_int(
            "round_deadline_seconds",
            self.round_deadline_seconds.unwrap_or(3600),
            MIN_DEADLINE_SECONDS,
            MAX_DEADLINE_SECONDS,
        );
        // The default fits the deadline: a partner who sets a short deadline alone is never
        // refused over a field it did not send.
        let default_timeout = round_deadline_seconds.map_or(600, |d| i64::from(d).min(600));
        let assignment_timeout_seconds = p.int(
            "assignment_timeout_seconds",
            self.assignment_timeout_seconds.unwrap_or(default_timeout),
            MIN_DEADLINE_SECONDS,
            round_deadline_seconds.map_or(MAX_DEADLINE_SECONDS, i64::from),
        );
        let round_deadline_seconds = round_deadline_seconds.unwrap_or(MIN_DEADLINE_SECONDS as u32);
        let max_round_attempts = p.int(
            "max_round_attempts",
            self.max_round_attempts.unwrap_or(3),
            1,
            MAX_ROUND_ATTEMPTS,
        );
        if let Some(range) = &self.client_version {
            validate_version_range(&mut p, range);
        }
        validate_constraints(&mut p, &self.constraints);
        let privacy = privacy::validate(&mut p, &self.privacy, rounds, report_goal);
        let evaluation = self.evaluation.as_ref().map(|e| {
            let default_stddev = |every, on_demand, max_examples| {
                privacy::default_evaluation_stddev(
                    &privacy,
                    rounds,
                    report_goal,
                    (every, on_demand, max_examples),
                )
            };
            evaluation::validate(&mut p, e, rounds_valid.then_some(rounds), default_stddev)
        });
        let server_learning_rate = p.float(
            "server_learning_rate",
            self.server_learning_rate.unwrap_or(1.0),
            0.0,
            true,
            MAX_LEARNING_RATE,
        );
        let plan = self
            .plan
            .unwrap_or_else(|| serde_json::Value::Object(Default::default()));
        if !plan.is_object() {
            p.add("plan", "must be a JSON object");
        } else if serde_json::to_vec(&plan).map_or(usize::MAX, |v| v.len()) > MAX_PLAN_BYTES {
            p.add(
                "plan",
                format!("must be at most {MAX_PLAN_BYTES} bytes as JSON"),
            );
        }
        let device_seconds_per_round = p.int(
            "device_seconds_per_round",
            self.device_seconds_per_round
                .unwrap_or(i64::from(DEFAULT_DEVICE_SECONDS_PER_ROUND)),
            1,
            86_400,
        );
        if let Some(auth) = &self.device_auth {
            auth.validate(&mut p);
        }
        let upload_window = match self.upload_window {
            Some(window) => window.validate(&mut p, assignment_timeout_seconds),
            None => {
                UploadWindowSpec::default_for(device_seconds_per_round, assignment_timeout_seconds)
            }
        };
        let server_optimizer = self.server_optimizer.unwrap_or_default();
        if let Err(why) = server_optimizer.validate() {
            p.add("server_optimizer", why);
        }
        let mut privacy = privacy;
        if p.0.is_empty() && privacy.names_blt() {
            let side = DpMechanism {
                noise: Mechanism::Gaussian,
                adaptive_clipping: privacy.adaptive_clipping.map(|a| a.policy()),
                evaluation: evaluation.map(|e| e.policy()),
                health: privacy.health.map(|h| h.policy()),
                weighting: privacy.weighting.map(|w| w.policy()),
            };
            if let Err(problem) = privacy::resolve_blt(&mut privacy, side, rounds) {
                p.add("privacy.blt", problem);
            }
        }
        let mechanism = DpMechanism {
            // Only a valid request's is checked (an unresolved BLT makes none).
            noise: match p.0.is_empty() {
                true => privacy.mechanism(),
                false => Mechanism::Gaussian,
            },
            adaptive_clipping: privacy.adaptive_clipping.map(|a| a.policy()),
            evaluation: evaluation.map(|e| e.policy()),
            health: privacy.health.map(|h| h.policy()),
            weighting: privacy.weighting.map(|w| w.policy()),
        };
        if p.0.is_empty()
            && let Some(query) = &query
            && let Err(problem) = confed_dp::analytics::check_analytics_plan(
                &confed_dp::ClosedForm,
                query,
                privacy.epsilon,
                privacy.delta,
                rounds,
                report_goal,
            )
        {
            p.add("privacy", problem.to_string());
        }
        if p.0.is_empty()
            && query.is_none()
            && let Err(problem) = confed_dp::check_plan(
                &confed_dp::ClosedForm,
                mechanism,
                privacy.epsilon,
                privacy.delta,
                rounds,
                report_goal,
            )
        {
            // The enclave calibrates the same way at every release (with OpenDP's maps, which
            // the closed form matches to 1e-9); a plan it could not run usefully is refused
            // now, saying what to change.
            p.add("privacy", problem.to_string());
        }
        if !p.0.is_empty() {
            return Err(p.0);
        }
        Ok(TaskSpec {
            kind: match query {
                Some(_) => TaskKind::Analytics,
                None => TaskKind::Training,
            },
            analytics: query,
            name,
            population: self.population,
            rounds,
            report_goal,
            min_reports,
            over_selection,
            round_deadline_seconds,
            assignment_timeout_seconds,
            max_round_attempts,
            client_version: self.client_version,
            constraints: self.constraints,
            privacy,
            server_learning_rate,
            plan,
            server_optimizer,
            device_seconds_per_round,
            evaluation,
            device_auth: self.device_auth,
            upload_window: Some(upload_window),
            // Set by `Tasks::create` from the key services' masking keys.
            masking: None,
        })
    }
}

/// The OpenAPI schema of `constraints`, with the bounds `validate_constraints` enforces.
fn constraints_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Ref, Schema, SchemaType, Type};
    let value = OneOfBuilder::new()
        .item(ObjectBuilder::new().schema_type(SchemaType::new(Type::Boolean)))
        .item(
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::String))
                .max_length(Some(256)),
        )
        .item(Ref::from_schema_name("NumericRange"));
    ObjectBuilder::new()
        .schema_type(SchemaType::new(Type::Object))
        .description(Some(
            "Device attributes a device must match: at most 32, names 1-64 of a-z 0-9 _; a \
             boolean, a string of at most 256 bytes, or a numeric range",
        ))
        .max_properties(Some(MAX_CONSTRAINTS))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::String))
                .pattern(Some("^[a-z0-9_]{1,64}$")),
        ))
        .additional_properties(Some(Schema::OneOf(value.build())))
        .build()
}

fn validate_version_range(p: &mut Problems, range: &VersionRange) {
    let mut parsed = |name: &str, value: &Option<String>| {
        value.as_deref().and_then(|text| {
            let version = parse_version(text);
            if version.is_none() {
                p.add(
                    name,
                    format!("must be a dotted numeric version like \"1.4.0\" (got {text:?})"),
                );
            }
            version
        })
    };
    let min = parsed("client_version.min", &range.min);
    let max = parsed("client_version.max", &range.max);
    if let (Some(min), Some(max)) = (min, max)
        && min > max
    {
        p.add("client_version", "min must not be greater than max");
    }
}

fn validate_constraints(p: &mut Problems, constraints: &BTreeMap<String, Constraint>) {
    if constraints.len() > MAX_CONSTRAINTS {
        p.add(
            "constraints",
            format!(
                "at most {MAX_CONSTRAINTS} attributes (got {})",
                constraints.len()
            ),
        );
    }
    for (name, constraint) in constraints {
        let field = format!("constraints.{name}");
        let name_ok = (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_');
        if !name_ok {
            p.add(
                &field,
                "attribute names are 1-64 characters of a-z, 0-9, '_'",
            );
        }
        match constraint {
            Constraint::Text(text) if text.len() > 256 => {
                p.add(&field, "string values are at most 256 bytes")
            }
            Constraint::Range(NumericRange { min, max }) => {
                let finite = min.is_none_or(f64::is_finite) && max.is_none_or(f64::is_finite);
                if !finite || (min.is_none() && max.is_none()) {
                    p.add(&field, "a range needs a finite `min`, `max` or both");
                } else if let (Some(lo), Some(hi)) = (min, max)
                    && lo > hi
                {
                    p.add(&field, "min must not be greater than max");
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod analytics_tests;
#[cfg(test)]
mod tests;
