//! What a partner asks for when creating a task, and its validation into a `TaskSpec`.
//! Every field is checked; every problem is reported with the field's name and allowed range, all
//! at once, so a partner fixes a request in one go.

use confed_enclave::optimizer::ServerOptimizer;
use confed_enclave::policy::{
    AdaptiveClipping, DpMechanism, MAX_MIN_SEPARATION, Mechanism, TaskPolicy,
};
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub const MAX_ROUNDS: i64 = 10_000;
pub const MAX_REPORT_GOAL: i64 = 1_000_000;
pub const MAX_OVER_SELECTION: f64 = 10.0;
pub const MIN_DEADLINE_SECONDS: i64 = 10;
pub const MAX_DEADLINE_SECONDS: i64 = 7 * 24 * 3600;
pub const MAX_ROUND_ATTEMPTS: i64 = 10;
/// The enclave's own limits: it refuses to release under a looser budget whatever the database says.
pub const MAX_EPSILON: f64 = confed_enclave::policy::MAX_TASK_EPSILON;
pub const MAX_DELTA: f64 = confed_enclave::policy::MAX_TASK_DELTA;
/// The enclave's range for the clip norm (below it the grid's unit underflows).
pub const MIN_CLIP_NORM: f64 = confed_enclave::policy::MIN_CLIP_NORM;
pub const MAX_CLIP_NORM: f64 = confed_enclave::policy::MAX_CLIP_NORM;
pub const MAX_LEARNING_RATE: f64 = 100.0;
pub const MAX_PLAN_BYTES: usize = 64 * 1024;
pub const MAX_CONSTRAINTS: usize = 32;
pub const MAX_POPULATION_LEN: usize = 128;

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

/// The task's total differential-privacy budget over all its rounds, and the L2 clipping bound of
/// one device's update.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PrivacyBudget {
    /// Total over all rounds, (0, 100].
    #[schema(exclusive_minimum = 0.0, maximum = 100.0)]
    pub epsilon: f64,
    /// (0, 0.01].
    #[schema(exclusive_minimum = 0.0, maximum = 0.01)]
    pub delta: f64,
    /// L2 bound of one device's update, [1e-6, 1e6].
    #[schema(minimum = 0.000001, maximum = 1000000.0)]
    pub clip_norm: f64,
    /// `gaussian` (default: independent noise on every round) or `tree_aggregation` (DP-FTRL:
    /// correlated tree noise, devices serve rounds at least `min_separation` apart).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mechanism: Option<MechanismName>,
    /// `tree_aggregation` only: fewest rounds between two rounds one device serves, and the
    /// length of each noise tree, 1-1024 (default: the task's rounds, at most 1024).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 1, maximum = 1024)]
    pub min_separation: Option<u32>,
    /// Adaptive clipping (Andrew et al. 2021): `clip_norm` is the first round's, and each round's
    /// moves toward the `target_quantile` of the update norms. Every field is optional:
    /// `target_quantile` in (0, 0.99] (default 0.5), `learning_rate` in (0, 10] (default 0.2),
    /// `count_stddev` in [0.5, 1e6] (default report_goal / 20, at least 0.5).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adaptive_clipping: Option<AdaptiveClippingSpec>,
}

/// `privacy.adaptive_clipping`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AdaptiveClippingSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0.0, maximum = 0.99)]
    pub target_quantile: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(exclusive_minimum = 0.0, maximum = 10.0)]
    pub learning_rate: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(minimum = 0.5, maximum = 1000000.0)]
    pub count_stddev: Option<f64>,
}

/// The DP mechanisms a task may choose (docs/privacy.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum MechanismName {
    Gaussian,
    TreeAggregation,
}

impl PrivacyBudget {
    /// The whole mechanism the task policy names (a validated spec has every adaptive-clipping
    /// field filled in).
    pub fn dp_mechanism(&self) -> DpMechanism {
        DpMechanism {
            noise: self.mechanism(),
            adaptive_clipping: self.adaptive_clipping.map(|a| AdaptiveClipping {
                target_quantile: a.target_quantile.unwrap_or(0.5),
                learning_rate: a.learning_rate.unwrap_or(0.2),
                count_stddev: a.count_stddev.unwrap_or(1.0),
            }),
        }
    }

    /// The noise mechanism the task policy names.
    pub fn mechanism(&self) -> Mechanism {
        match self.mechanism {
            Some(MechanismName::TreeAggregation) => Mechanism::Tree {
                min_separation: self.min_separation.unwrap_or(MAX_MIN_SEPARATION),
            },
            _ => Mechanism::Gaussian,
        }
    }
}

/// `POST /v1/tasks` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTaskRequest {
    /// Device population this task trains on: 1-128 of `A-Z a-z 0-9 . _ -`.
    #[schema(pattern = r"^[A-Za-z0-9._-]{1,128}$")]
    pub population: String,
    /// Planned number of rounds, 1-10000.
    #[serde(deserialize_with = "crate::api::integers::i64")]
    #[schema(minimum = 1, maximum = 10000)]
    pub rounds: i64,
    /// Reports that close a round, 1-1000000 (and at most the tenant's quota).
    #[serde(deserialize_with = "crate::api::integers::i64")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub report_goal: i64,
    /// Fewest reports a round may close with at its deadline, 1..=report_goal (default report_goal).
    #[serde(default, deserialize_with = "crate::api::integers::option_i64")]
    #[schema(minimum = 1, maximum = 1000000)]
    pub min_reports: Option<i64>,
    /// Extra assignments handed out beyond the report goal, 0-10 (default 0.3).
    #[serde(default)]
    #[schema(minimum = 0.0, maximum = 10.0)]
    pub over_selection: Option<f64>,
    /// How long a round collects before its deadline, 10-604800 s (default 3600).
    #[serde(default, deserialize_with = "crate::api::integers::option_i64")]
    #[schema(minimum = 10, maximum = 604800)]
    pub round_deadline_seconds: Option<i64>,
    /// How long a device has for one assignment, 10..=round_deadline_seconds (default 600).
    #[serde(default, deserialize_with = "crate::api::integers::option_i64")]
    #[schema(minimum = 10, maximum = 604800)]
    pub assignment_timeout_seconds: Option<i64>,
    /// Attempts per round before the task fails, 1-10 (default 3).
    #[serde(default, deserialize_with = "crate::api::integers::option_i64")]
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
    #[serde(default, deserialize_with = "crate::api::integers::option_i64")]
    #[schema(minimum = 1, maximum = 86400)]
    pub device_seconds_per_round: Option<i64>,
}

/// A validated task definition, as stored and as returned to the partner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct TaskSpec {
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
    /// from (`confed_enclave::policy`): derived from the stored definition, which never changes
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
            mechanism: self.privacy.dp_mechanism().encode(),
            server_learning_rate: self.server_learning_rate,
            plan: serde_json::to_string(&self.plan).unwrap_or_else(|_| "{}".into()),
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

/// One invalid field of a request (RFC 7807 `invalid_params` member).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct InvalidParam {
    pub name: String,
    pub reason: String,
}

#[derive(Default)]
struct Problems(Vec<InvalidParam>);

impl Problems {
    fn add(&mut self, name: &str, reason: impl Into<String>) {
        self.0.push(InvalidParam {
            name: name.to_string(),
            reason: reason.into(),
        });
    }

    /// `Some(value)` if within [lo, hi]; otherwise records the problem and returns `None`.
    fn checked_int(&mut self, name: &str, value: i64, lo: i64, hi: i64) -> Option<u32> {
        if (lo..=hi).contains(&value) {
            Some(value as u32)
        } else {
            self.add(name, format!("must be between {lo} and {hi} (got {value})"));
            None
        }
    }

    fn int(&mut self, name: &str, value: i64, lo: i64, hi: i64) -> u32 {
        self.checked_int(name, value, lo, hi).unwrap_or(lo as u32)
    }

    /// `lo_open` makes the lower bound exclusive: (lo, hi] instead of [lo, hi].
    fn float(&mut self, name: &str, value: f64, lo: f64, lo_open: bool, hi: f64) -> f64 {
        let above_lo = if lo_open { value > lo } else { value >= lo };
        if value.is_finite() && above_lo && value <= hi {
            value
        } else {
            let open = if lo_open { "(" } else { "[" };
            self.add(name, format!("must be in {open}{lo}, {hi}] (got {value})"));
            hi
        }
    }
}

impl CreateTaskRequest {
    /// Checks every field; on failure returns every invalid field with what is allowed.
    pub fn validate(self) -> Result<TaskSpec, Vec<InvalidParam>> {
        let mut p = Problems::default();
        if !valid_population(&self.population) {
            p.add(
                "population",
                format!(
                    "must be 1-{MAX_POPULATION_LEN} characters of A-Z, a-z, 0-9, '.', '_', '-'"
                ),
            );
        }
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
        let assignment_timeout_seconds = p.int(
            "assignment_timeout_seconds",
            self.assignment_timeout_seconds.unwrap_or(600),
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
        let privacy = PrivacyBudget {
            epsilon: p.float(
                "privacy.epsilon",
                self.privacy.epsilon,
                0.0,
                true,
                MAX_EPSILON,
            ),
            delta: p.float("privacy.delta", self.privacy.delta, 0.0, true, MAX_DELTA),
            clip_norm: p.float(
                "privacy.clip_norm",
                self.privacy.clip_norm,
                MIN_CLIP_NORM,
                false,
                MAX_CLIP_NORM,
            ),
            mechanism: self.privacy.mechanism,
            min_separation: match self.privacy.mechanism {
                Some(MechanismName::TreeAggregation) => {
                    let default = rounds.clamp(1, MAX_MIN_SEPARATION);
                    let given = self.privacy.min_separation.unwrap_or(default);
                    Some(p.int(
                        "privacy.min_separation",
                        i64::from(given),
                        1,
                        i64::from(MAX_MIN_SEPARATION),
                    ))
                }
                _ => {
                    if self.privacy.min_separation.is_some() {
                        p.add(
                            "privacy.min_separation",
                            "applies to `\"mechanism\": \"tree_aggregation\"` only; set the mechanism or leave it out",
                        );
                    }
                    None
                }
            },
            adaptive_clipping: self
                .privacy
                .adaptive_clipping
                .map(|a| AdaptiveClippingSpec {
                    target_quantile: Some(p.float(
                        "privacy.adaptive_clipping.target_quantile",
                        a.target_quantile.unwrap_or(0.5),
                        0.0,
                        true,
                        0.99,
                    )),
                    learning_rate: Some(p.float(
                        "privacy.adaptive_clipping.learning_rate",
                        a.learning_rate.unwrap_or(0.2),
                        0.0,
                        true,
                        10.0,
                    )),
                    count_stddev: Some(
                        p.float(
                            "privacy.adaptive_clipping.count_stddev",
                            a.count_stddev
                                .unwrap_or((f64::from(report_goal) / 20.0).max(0.5)),
                            0.5,
                            false,
                            1e6,
                        ),
                    ),
                }),
        };
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
        let server_optimizer = self.server_optimizer.unwrap_or_default();
        if let Err(why) = server_optimizer.validate() {
            p.add("server_optimizer", why);
        }
        if p.0.is_empty()
            && let Err(problem) = confed_enclave::dp::check_plan(
                privacy.dp_mechanism(),
                privacy.epsilon,
                privacy.delta,
                rounds,
                report_goal,
            )
        {
            // The enclave calibrates the same way at every release; a plan it could not run
            // usefully is refused now, saying what to change.
            p.add("privacy", problem.to_string());
        }
        if !p.0.is_empty() {
            return Err(p.0);
        }
        Ok(TaskSpec {
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

pub fn valid_population(population: &str) -> bool {
    (1..=MAX_POPULATION_LEN).contains(&population.len())
        && population
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Parses a dotted numeric version (`"1"`, `"1.4"`, `"2.0.1"`, at most 4 parts).
pub fn parse_version(text: &str) -> Option<Vec<u32>> {
    let parts: Option<Vec<u32>> = text.split('.').map(|p| p.parse().ok()).collect();
    parts.filter(|p| (1..=4).contains(&p.len()))
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
mod tests {
    use super::*;

    #[test]
    fn capacity_adapts_to_the_drop_out_rate_within_the_cap() {
        let spec: TaskSpec = serde_json::from_value::<CreateTaskRequest>(serde_json::json!({
            "population": "p", "rounds": 1, "report_goal": 10, "over_selection": 0.3,
            "privacy": {"epsilon": 8.0, "delta": 1e-6, "clip_norm": 1.0},
        }))
        .unwrap()
        .validate()
        .unwrap();
        assert_eq!(spec.capacity_for(None), 13, "no evidence: the task's own");
        assert_eq!(
            spec.capacity_for(Some(0.1)),
            13,
            "never below the task's own"
        );
        // 40 % dropped: 1 / 0.6 - 1 = 0.667 over-selection.
        assert_eq!(spec.capacity_for(Some(0.4)), 17);
        assert_eq!(spec.capacity_for(Some(0.9)), 20, "at most doubled");
        assert_eq!(spec.capacity_for(Some(1.0)), 20);
    }
    use serde_json::json;

    fn request(overrides: serde_json::Value) -> CreateTaskRequest {
        let mut base = json!({
            "population": "keyboards.en",
            "rounds": 5,
            "report_goal": 100,
            "privacy": {"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0},
        });
        base.as_object_mut()
            .unwrap()
            .extend(overrides.as_object().unwrap().clone());
        serde_json::from_value(base).unwrap()
    }

    fn invalid_names(overrides: serde_json::Value) -> Vec<String> {
        request(overrides)
            .validate()
            .unwrap_err()
            .into_iter()
            .map(|p| p.name)
            .collect()
    }

    /// DP-FTRL is chosen in `privacy`: its policy names the tree and the separation (the task's
    /// rounds when not given); a separation without the tree, or outside 1..=1024, is refused.
    #[test]
    fn a_tree_aggregation_task_names_its_separation_in_the_policy() {
        let tree = |privacy: serde_json::Value| request(json!({ "privacy": privacy }));
        let spec = tree(json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                               "mechanism": "tree_aggregation"}))
        .validate()
        .unwrap();
        assert_eq!(spec.privacy.min_separation, Some(5));
        assert_eq!(
            spec.policy("t", "x").mechanism,
            "tree_aggregation_on_grid;min_separation=5"
        );
        let spec = tree(json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                               "mechanism": "tree_aggregation", "min_separation": 2}))
        .validate()
        .unwrap();
        assert_eq!(
            spec.privacy.mechanism(),
            Mechanism::Tree { min_separation: 2 }
        );
        let gaussian = request(json!({})).validate().unwrap();
        assert_eq!(
            gaussian.policy("t", "x").mechanism,
            "discrete_gaussian_on_grid"
        );
        assert!(
            !serde_json::to_string(&gaussian)
                .unwrap()
                .contains("mechanism"),
            "stored Gaussian tasks keep their old form"
        );
        for privacy in [
            json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0, "min_separation": 2}),
            json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                   "mechanism": "tree_aggregation", "min_separation": 0}),
            json!({"epsilon": 4.0, "delta": 1e-6, "clip_norm": 1.0,
                   "mechanism": "tree_aggregation", "min_separation": 1025}),
        ] {
            assert_eq!(
                invalid_names(json!({ "privacy": privacy })),
                ["privacy.min_separation"]
            );
        }
    }

    #[test]
    fn a_plan_whose_rounds_cannot_fit_the_budget_is_refused_with_what_to_change() {
        let problems = request(json!({"rounds": 1000, "report_goal": 20,
            "privacy": {"epsilon": 0.5, "delta": 1e-6, "clip_norm": 1.0}}))
        .validate()
        .unwrap_err();
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].name, "privacy");
        assert!(
            problems[0].reason.contains("Raise report_goal to at least"),
            "{}",
            problems[0].reason
        );
        assert!(problems[0].reason.contains("plan fewer rounds"));
    }

    #[test]
    fn defaults_fill_optional_fields() {
        let spec = request(json!({})).validate().unwrap();
        assert_eq!(spec.min_reports, 100);
        assert_eq!(spec.over_selection, 0.3);
        assert_eq!(spec.round_deadline_seconds, 3600);
        assert_eq!(spec.assignment_timeout_seconds, 600);
        assert_eq!(spec.max_round_attempts, 3);
        assert_eq!(spec.server_learning_rate, 1.0);
        assert_eq!(spec.plan, json!({}));
        assert_eq!(spec.max_live_assignments(), 130);
    }

    #[test]
    fn each_out_of_range_field_is_named() {
        let cases = [
            (json!({"population": ""}), "population"),
            (json!({"population": "has space"}), "population"),
            (json!({"rounds": 0}), "rounds"),
            (json!({"rounds": 10_001}), "rounds"),
            (json!({"report_goal": -1}), "report_goal"),
            (json!({"min_reports": 101}), "min_reports"),
            (json!({"min_reports": 0}), "min_reports"),
            (json!({"over_selection": -0.1}), "over_selection"),
            (
                json!({"round_deadline_seconds": 5}),
                "round_deadline_seconds",
            ),
            (
                json!({"assignment_timeout_seconds": 4000}),
                "assignment_timeout_seconds",
            ),
            (json!({"max_round_attempts": 11}), "max_round_attempts"),
            (
                json!({"client_version": {"min": "1.x"}}),
                "client_version.min",
            ),
            (
                json!({"client_version": {"min": "2.0", "max": "1.9"}}),
                "client_version",
            ),
            (
                json!({"constraints": {"Bad Name": true}}),
                "constraints.Bad Name",
            ),
            (
                json!({"constraints": {"ram_gb": {"min": 8, "max": 4}}}),
                "constraints.ram_gb",
            ),
            (json!({"constraints": {"ram_gb": {}}}), "constraints.ram_gb"),
            (
                json!({"privacy": {"epsilon": 0.0, "delta": 1e-6, "clip_norm": 1.0}}),
                "privacy.epsilon",
            ),
            (
                json!({"privacy": {"epsilon": 1.0, "delta": 0.5, "clip_norm": 1.0}}),
                "privacy.delta",
            ),
            (
                json!({"privacy": {"epsilon": 1.0, "delta": 1e-6, "clip_norm": -1.0}}),
                "privacy.clip_norm",
            ),
            (
                // Subnormal: the grid's unit would underflow and no clip could ever fit.
                json!({"privacy": {"epsilon": 1.0, "delta": 1e-6, "clip_norm": 5e-324}}),
                "privacy.clip_norm",
            ),
            (json!({"server_learning_rate": 0.0}), "server_learning_rate"),
            (json!({"plan": [1, 2]}), "plan"),
        ];
        for (overrides, field) in cases {
            assert_eq!(invalid_names(overrides.clone()), vec![field], "{overrides}");
        }
    }

    #[test]
    fn all_problems_are_reported_together_with_ranges() {
        let problems = request(json!({"rounds": 0, "report_goal": 0}))
            .validate()
            .unwrap_err();
        assert_eq!(problems.len(), 2);
        assert_eq!(problems[0].reason, "must be between 1 and 10000 (got 0)");
    }

    #[test]
    fn oversized_plan_is_refused() {
        let big = "x".repeat(MAX_PLAN_BYTES);
        assert_eq!(invalid_names(json!({"plan": {"blob": big}})), vec!["plan"]);
    }

    #[test]
    fn constraints_and_versions_round_trip() {
        let spec = request(json!({
            "client_version": {"min": "1.2", "max": "3"},
            "constraints": {"os": "android", "charging": true, "ram_gb": {"min": 4}},
        }))
        .validate()
        .unwrap();
        let text = serde_json::to_string(&spec).unwrap();
        let back: TaskSpec = serde_json::from_str(&text).unwrap();
        assert_eq!(back, spec);
        assert_eq!(back.constraints["charging"], Constraint::Flag(true));
    }

    #[test]
    fn versions_parse_as_numbers() {
        assert!(parse_version("1.10").unwrap() > parse_version("1.9").unwrap());
        assert_eq!(parse_version("1.2.3.4.5"), None);
        assert_eq!(parse_version(""), None);
    }
}
