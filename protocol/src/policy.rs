//! The task policy: what a task may do with the contributions sealed under it, in one canonical
//! text that devices bind (by its SHA-256) into the associated data of every contribution.
//!
//! The database and the front ends that hold a task's parameters are untrusted. So the parameters
//! that bound a device's privacy travel to the device as this text, the device checks them against
//! the limits of its own trust file and seals its update to their hash, and the enclave takes the
//! parameters it applies from the same text (after checking it against the limits compiled into
//! the attested image). A policy changed anywhere outside the device makes every contribution
//! sealed under the original fail to open.
//!
//! ```text
//! confed-task-policy/v3\n
//! task_id=<id>\n  tenant_id=<id>\n  population=<population>\n
//! rounds=<u32>\n  report_goal=<u32>\n  min_reports=<u32>\n
//! epsilon=<f64>\n  delta=<f64>\n  clip_norm=<f64>\n
//! mechanism=discrete_gaussian_on_grid | tree_aggregation_on_grid;min_separation=<u32>\n
//! server_learning_rate=<f64>\n
//! plan=<compact JSON object>\n
//! upload_window=<start_ms>,<end_ms>\n
//! [device_auth=privacy_pass;issuer=<name>;token_keys=<base64url SPKI>,...\n]
//! [masking=confed-masking/v1;threshold=<t>;services=<id>:<verifying_key>:<key>:<signature>,...\n]
//! [analytics=<query>\n]
//! ```
//!
//! Exactly these lines, in this order, each ended by one `\n`; `device_auth` only when the task
//! requires device tokens (`device_auth.rs`), `masking` only when its updates are masked beneath
//! the enclave (`masking_keys.rs`), and `analytics` only for an analytics task (`analytics.rs`),
//! so a policy without them hashes as before. An analytics policy's training
//! lines hold fixed values (`ANALYTICS_CLIP_NORM`, `MECHANISM`, a learning rate of 1, plan `{}`):
//! one query has one policy text.
//! `upload_window` is when the device sends, in milliseconds after it received the assignment
//! (`upload_window.rs`; v3 added it: a v2 text is refused, its devices sent when training
//! ended). Integers are decimal without sign
//! or leading zeros; every `<f64>` is Rust's `{:e}` form of the value (the shortest digits that
//! read back to the same binary64, e.g. `4e0`, `1e-6`, `5e-2`), which every language's float
//! parser reads exactly. Ids and the population are 1-128 of `A-Z a-z 0-9 . _ -`. The plan is
//! the task's plan as compact JSON (no line breaks). Devices hash the bytes they received and
//! parse them; only the producer (the server) needs to encode.

use thiserror::Error;

pub use crate::analytics::AnalyticsQuery;
pub use crate::device_auth::DeviceAuth;
pub use crate::masking_keys::MaskingPolicy;
pub use crate::upload_window::{MAX_UPLOAD_WINDOW_MS, UploadWindow};

pub const FORMAT: &str = "confed-task-policy/v3";
/// Independent discrete Gaussian noise on every round (the default mechanism).
pub const MECHANISM: &str = "discrete_gaussian_on_grid";
/// DP-FTRL's tree-aggregated noise (`Mechanism::Tree`), followed by `;min_separation=<u32>`.
pub const TREE_MECHANISM: &str = "tree_aggregation_on_grid";
/// Longest minimum separation (and so tree) a policy may ask for: a round at the end of a tree
/// of `b` rounds samples `2b - 1` noise vectors (docs/privacy.md, "DP-FTRL").
pub const MAX_MIN_SEPARATION: u32 = 1024;
/// Longest policy text accepted (the plan is at most 64 KiB).
pub const MAX_POLICY_BYTES: usize = 80 * 1024;

/// Largest total epsilon and delta the enclave releases under, whatever the policy says: part of
/// the attested image, so no operator can loosen a task's privacy beyond them.
pub const MAX_TASK_EPSILON: f64 = 100.0;
pub const MAX_TASK_DELTA: f64 = 1e-2;
/// The clip norm's range: below the minimum the fixed-point grid's unit underflows.
pub const MIN_CLIP_NORM: f64 = 1e-6;
pub const MAX_CLIP_NORM: f64 = 1e6;

pub use crate::mechanism::{
    AdaptiveClipping, DpMechanism, EVALUATION_TENSOR, EXAMPLES_TENSOR, Evaluation, HEALTH_TENSOR,
    Health, MAX_EVALUATION_EVERY, MAX_EVALUATION_EXAMPLES, MAX_EVALUATION_LOSS,
    MAX_EVALUATION_STDDEV, MAX_HEALTH_STDDEV, MAX_ON_DEMAND_EVALUATIONS, MAX_WEIGHTING_EXAMPLES,
    MIN_EVALUATION_STDDEV, MIN_HEALTH_STDDEV, Mechanism, Weighting,
};

#[derive(Debug, Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error("task policy: {0}")]
    Malformed(String),
    #[error("task policy outside the limits: {0}")]
    Limits(String),
}

/// A task's policy (see the module documentation for the encoding).
#[derive(Debug, Clone, PartialEq)]
pub struct TaskPolicy {
    pub task_id: String,
    pub tenant_id: String,
    pub population: String,
    pub rounds: u32,
    pub report_goal: u32,
    pub min_reports: u32,
    pub epsilon: f64,
    pub delta: f64,
    pub clip_norm: f64,
    pub mechanism: String,
    pub server_learning_rate: f64,
    /// Compact JSON of the task's plan.
    pub plan: String,
    /// When a device sends after receiving its assignment (`upload_window.rs`).
    pub upload_window: UploadWindow,
    /// Device tokens every counted contribution must carry (`device_auth.rs`).
    pub device_auth: Option<DeviceAuth>,
    /// The key services that hold the mask seeds of a masked task (`masking_keys.rs`);
    /// `None`: updates are sealed in the clear to the enclave.
    pub masking: Option<MaskingPolicy>,
    /// The query of an analytics task (`analytics.rs`); `None` for training.
    pub analytics: Option<AnalyticsQuery>,
}

/// The clip norm line of an analytics policy: its bounds are the query's, and the line holds 1.
pub const ANALYTICS_CLIP_NORM: f64 = 1.0;

const KEYS: [&str; 13] = [
    "task_id",
    "tenant_id",
    "population",
    "rounds",
    "report_goal",
    "min_reports",
    "epsilon",
    "delta",
    "clip_norm",
    "mechanism",
    "server_learning_rate",
    "plan",
    "upload_window",
];

fn valid_name(text: &str) -> bool {
    (1..=128).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

impl TaskPolicy {
    /// A valid policy for `task_id` with `rounds` rounds, epsilon 4, delta 1e-6, clip norm 1 and
    /// one required contribution: for tests, benchmarks and examples.
    pub fn sample(task_id: &str, rounds: u32) -> Self {
        Self {
            task_id: task_id.to_string(),
            tenant_id: "sample-tenant".into(),
            population: "sample".into(),
            rounds,
            report_goal: 1,
            min_reports: 1,
            epsilon: 4.0,
            delta: 1e-6,
            clip_norm: 1.0,
            mechanism: MECHANISM.into(),
            server_learning_rate: 1.0,
            plan: "{}".into(),
            upload_window: UploadWindow {
                start_ms: 0,
                end_ms: 0,
            },
            device_auth: None,
            masking: None,
            analytics: None,
        }
    }

    /// The canonical text.
    pub fn encode(&self) -> String {
        let values = [
            self.task_id.clone(),
            self.tenant_id.clone(),
            self.population.clone(),
            self.rounds.to_string(),
            self.report_goal.to_string(),
            self.min_reports.to_string(),
            format!("{:e}", self.epsilon),
            format!("{:e}", self.delta),
            format!("{:e}", self.clip_norm),
            self.mechanism.clone(),
            format!("{:e}", self.server_learning_rate),
            self.plan.clone(),
            self.upload_window.encode(),
        ];
        let mut out = String::with_capacity(256 + self.plan.len());
        out.push_str(FORMAT);
        out.push('\n');
        for (key, value) in KEYS.iter().zip(values) {
            out.push_str(key);
            out.push('=');
            out.push_str(&value);
            out.push('\n');
        }
        if let Some(auth) = &self.device_auth {
            out.push_str("device_auth=");
            out.push_str(&auth.encode());
            out.push('\n');
        }
        if let Some(masking) = &self.masking {
            out.push_str("masking=");
            out.push_str(&masking.encode());
            out.push('\n');
        }
        if let Some(query) = &self.analytics {
            out.push_str("analytics=");
            out.push_str(&query.encode());
            out.push('\n');
        }
        out
    }

    /// Parses a policy text strictly: the fields of the format in order, every value well formed,
    /// and the text exactly the canonical encoding of what it says (so one policy has one hash).
    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let bad = |why: String| PolicyError::Malformed(why);
        if text.len() > MAX_POLICY_BYTES {
            return Err(bad(format!("longer than {MAX_POLICY_BYTES} bytes")));
        }
        let body = text
            .strip_suffix('\n')
            .ok_or_else(|| bad("must end with a line break".into()))?;
        let mut lines = body.split('\n');
        if lines.next() != Some(FORMAT) {
            return Err(bad(format!("the first line must be `{FORMAT}`")));
        }
        let mut values = Vec::with_capacity(KEYS.len());
        for key in KEYS {
            let line = lines
                .next()
                .ok_or_else(|| bad(format!("`{key}` is missing")))?;
            let value = line
                .strip_prefix(key)
                .and_then(|rest| rest.strip_prefix('='))
                .ok_or_else(|| bad(format!("expected `{key}=` at line `{line}`")))?;
            values.push(value);
        }
        let mut next = lines.next();
        let device_auth = match next.and_then(|line| line.strip_prefix("device_auth=")) {
            Some(value) => {
                next = lines.next();
                Some(DeviceAuth::parse(value).map_err(bad)?)
            }
            None => None,
        };
        let masking = match next.and_then(|line| line.strip_prefix("masking=")) {
            Some(value) => {
                next = lines.next();
                Some(MaskingPolicy::parse(value).map_err(bad)?)
            }
            None => None,
        };
        let analytics = match next.and_then(|line| line.strip_prefix("analytics=")) {
            Some(value) => {
                next = lines.next();
                Some(AnalyticsQuery::parse(value).map_err(bad)?)
            }
            None => None,
        };
        if next.is_some() {
            return Err(bad(
                "after `upload_window` only `device_auth=`, `masking=` and `analytics=` may follow, in that order".into(),
            ));
        }
        let name = |i: usize| -> Result<String, PolicyError> {
            valid_name(values[i])
                .then(|| values[i].to_string())
                .ok_or_else(|| bad(format!("`{}` must be 1-128 of A-Z a-z 0-9 . _ -", KEYS[i])))
        };
        let count = |i: usize| -> Result<u32, PolicyError> {
            values[i]
                .parse::<u32>()
                .map_err(|_| bad(format!("`{}` must be an unsigned integer", KEYS[i])))
        };
        let real = |i: usize| -> Result<f64, PolicyError> {
            values[i]
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| bad(format!("`{}` must be a finite number", KEYS[i])))
        };
        let plan = values[11];
        match serde_json::from_str::<serde_json::Value>(plan) {
            Ok(serde_json::Value::Object(_)) => {}
            _ => return Err(bad("`plan` must be a JSON object".into())),
        }
        let policy = Self {
            task_id: name(0)?,
            tenant_id: name(1)?,
            population: name(2)?,
            rounds: count(3)?,
            report_goal: count(4)?,
            min_reports: count(5)?,
            epsilon: real(6)?,
            delta: real(7)?,
            clip_norm: real(8)?,
            mechanism: values[9].to_string(),
            server_learning_rate: real(10)?,
            plan: plan.to_string(),
            upload_window: UploadWindow::parse(values[12]).map_err(bad)?,
            device_auth,
            masking,
            analytics,
        };
        if policy.encode() != text {
            return Err(bad(
                "not in canonical form (numbers as `{:e}` shortest round-trip, no leading zeros)"
                    .into(),
            ));
        }
        Ok(policy)
    }

    /// The noise mechanism the policy names (refused if this build does not run it).
    pub fn mechanism(&self) -> Result<Mechanism, PolicyError> {
        Mechanism::parse(&self.mechanism).map_err(PolicyError::Limits)
    }

    /// The whole mechanism: noise and adaptive clipping.
    pub fn dp_mechanism(&self) -> Result<DpMechanism, PolicyError> {
        DpMechanism::parse(&self.mechanism).map_err(PolicyError::Limits)
    }

    /// Lowercase hex SHA-256 of the canonical text: what devices bind into their contributions.
    pub fn sha256_hex(&self) -> String {
        sha256_hex(self.encode().as_bytes())
    }

    /// The limits of the attested image: refuses a policy no enclave of this build may release
    /// under, whatever the task database says.
    pub fn check_enclave_limits(&self) -> Result<(), PolicyError> {
        let mut problems = Vec::new();
        if !(self.epsilon > 0.0 && self.epsilon <= MAX_TASK_EPSILON) {
            problems.push(format!(
                "epsilon {} (must be in (0, {MAX_TASK_EPSILON}])",
                self.epsilon
            ));
        }
        if !(self.delta > 0.0 && self.delta <= MAX_TASK_DELTA) {
            problems.push(format!(
                "delta {} (must be in (0, {MAX_TASK_DELTA}])",
                self.delta
            ));
        }
        // The clip norm scales the grid: below this the grid's unit is subnormal.
        if !(MIN_CLIP_NORM..=MAX_CLIP_NORM).contains(&self.clip_norm) {
            problems.push(format!(
                "clip_norm {} (must be in [{MIN_CLIP_NORM}, {MAX_CLIP_NORM}])",
                self.clip_norm
            ));
        }
        if self.rounds == 0 {
            problems.push("rounds 0 (must be at least 1)".into());
        }
        if self.min_reports == 0 || self.min_reports > self.report_goal {
            problems.push(format!(
                "min_reports {} (must be 1..=report_goal {})",
                self.min_reports, self.report_goal
            ));
        }
        match Mechanism::parse(&self.mechanism) {
            Err(why) => problems.push(why),
            // The accounting's allowance for the BLT fixed point's error holds up to this many
            // rounds (`confed_dp::blt_accounting::ROUNDING_MARGIN`).
            Ok(Mechanism::Blt(_)) if self.rounds > crate::blt_noise::MAX_BLT_ROUNDS => {
                problems.push(format!(
                    "rounds {} (BLT noise runs at most {} rounds)",
                    self.rounds,
                    crate::blt_noise::MAX_BLT_ROUNDS
                ));
            }
            Ok(_) => {}
        }
        if let Some(query) = &self.analytics {
            problems.extend(query.problems().into_iter().map(|p| p.reason));
            // One query, one policy text: the training lines an analytics task does not use
            // hold fixed values, so no two texts (and hashes) mean the same task.
            let fixed = self.clip_norm == ANALYTICS_CLIP_NORM
                && self.mechanism == MECHANISM
                && self.server_learning_rate == 1.0
                && self.plan == "{}";
            if !fixed {
                problems.push(format!(
                    "an analytics policy has clip_norm=1e0, mechanism={MECHANISM}, server_learning_rate=1e0 and plan={{}}"
                ));
            }
        }
        if self.masking.is_some() {
            problems.extend(crate::masking_keys::policy_problems(self));
        }
        if !(self.server_learning_rate > 0.0 && self.server_learning_rate <= 100.0) {
            problems.push(format!(
                "server_learning_rate {} (must be in (0, 100])",
                self.server_learning_rate
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(PolicyError::Limits(problems.join("; ")))
        }
    }
}

/// What a device accepts: the limits of its trust file, checked before it seals anything.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceLimits {
    /// Largest total epsilon of a task this device contributes to.
    pub max_epsilon: f64,
    /// Largest delta.
    pub max_delta: f64,
    /// Fewest contributions a release of the task may average (the policy's `min_reports`).
    pub min_reports: u32,
}

impl DeviceLimits {
    /// The enclave's own limits: a device that states these accepts any policy an enclave of
    /// this build would release under (for development and tests; a real deployment's devices
    /// state tighter ones).
    pub const ENCLAVE: Self = Self {
        max_epsilon: MAX_TASK_EPSILON,
        max_delta: MAX_TASK_DELTA,
        min_reports: 1,
    };

    /// Refuses a policy outside these limits, or one the enclave itself would refuse, naming why.
    pub fn check(&self, policy: &TaskPolicy) -> Result<(), PolicyError> {
        policy.check_enclave_limits()?;
        let mut problems = Vec::new();
        if policy.epsilon > self.max_epsilon {
            problems.push(format!(
                "epsilon {} is above this device's limit {}",
                policy.epsilon, self.max_epsilon
            ));
        }
        if policy.delta > self.max_delta {
            problems.push(format!(
                "delta {} is above this device's limit {}",
                policy.delta, self.max_delta
            ));
        }
        if policy.min_reports < self.min_reports {
            problems.push(format!(
                "min_reports {} is below this device's limit {}",
                policy.min_reports, self.min_reports
            ));
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(PolicyError::Limits(problems.join("; ")))
        }
    }
}

pub use crate::hex::sha256_hex;

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn example() -> TaskPolicy {
        TaskPolicy {
            task_id: "d63967eb-1074-43a4-92b2-8968c90e7949".into(),
            tenant_id: "3f1c9a0e6b7d4e21".into(),
            population: "phones.en".into(),
            rounds: 5,
            report_goal: 100,
            min_reports: 60,
            epsilon: 4.0,
            delta: 1e-6,
            clip_norm: 1.0,
            mechanism: MECHANISM.into(),
            server_learning_rate: 1.0,
            plan: r#"{"batch_size":32,"epochs":1,"learning_rate":0.05}"#.into(),
            upload_window: UploadWindow {
                start_ms: 30_000,
                end_ms: 90_000,
            },
            device_auth: None,
            masking: None,
            analytics: None,
        }
    }

    #[test]
    fn encoding_is_the_documented_text_and_parses_back() {
        let policy = example();
        let text = policy.encode();
        assert_eq!(
            text,
            "confed-task-policy/v3\ntask_id=d63967eb-1074-43a4-92b2-8968c90e7949\n\
             tenant_id=3f1c9a0e6b7d4e21\npopulation=phones.en\nrounds=5\nreport_goal=100\n\
             min_reports=60\nepsilon=4e0\ndelta=1e-6\nclip_norm=1e0\n\
             mechanism=discrete_gaussian_on_grid\nserver_learning_rate=1e0\n\
             plan={\"batch_size\":32,\"epochs\":1,\"learning_rate\":0.05}\n\
             upload_window=30000,90000\n"
        );
        assert_eq!(TaskPolicy::parse(&text).unwrap(), policy);
    }

    #[test]
    fn a_device_auth_line_follows_the_plan_and_parses_back_strictly() {
        let mut policy = example();
        let key = crate::device_auth::tests::vector_key();
        policy.device_auth = Some(DeviceAuth::new("issuer.example", vec![key]).unwrap());
        let text = policy.encode();
        assert!(text.contains("\ndevice_auth=privacy_pass;issuer=issuer.example;token_keys="));
        assert!(text.ends_with('\n'));
        assert_eq!(TaskPolicy::parse(&text).unwrap(), policy);
        assert_ne!(policy.sha256_hex(), example().sha256_hex());
        for bad in [
            format!("{text}x=1\n"),
            text.replace("device_auth=", "device-auth="),
            text.replace("issuer=issuer.example", "issuer=other;"),
        ] {
            assert!(TaskPolicy::parse(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn an_analytics_line_comes_last_and_binds_the_query() {
        let mut policy = TaskPolicy::sample("t", 3);
        policy.analytics = Some(AnalyticsQuery::OpenHistogram {
            max_key_bytes: 32,
            keys_per_device: 16,
        });
        let text = policy.encode();
        assert!(text.ends_with(
            "\nupload_window=0,0\nanalytics=open_histogram;max_key_bytes=32;keys_per_device=16\n"
        ));
        assert_eq!(TaskPolicy::parse(&text).unwrap(), policy);
        assert!(policy.check_enclave_limits().is_ok());
        assert_ne!(policy.sha256_hex(), TaskPolicy::sample("t", 3).sha256_hex());

        let key = crate::device_auth::tests::vector_key();
        policy.device_auth = Some(DeviceAuth::new("issuer.example", vec![key]).unwrap());
        let both = policy.encode();
        assert_eq!(TaskPolicy::parse(&both).unwrap(), policy);
        // The order is fixed: the query after the device tokens.
        let (head, query) = both.split_at(both.find("analytics=").unwrap());
        let (head, auth) = head.split_at(head.find("device_auth=").unwrap());
        assert!(TaskPolicy::parse(&format!("{head}{query}{auth}")).is_err());

        // Training lines an analytics task does not use hold their fixed values.
        policy.clip_norm = 2.0;
        let err = policy.check_enclave_limits().unwrap_err().to_string();
        assert!(
            err.contains("an analytics policy has clip_norm=1e0"),
            "{err}"
        );
    }

    #[test]
    fn every_float_round_trips_exactly() {
        for value in [0.1, 1e-6, 2.5e-7, 4.0, 8.0 / 3.0, 1e-300, 123456.789] {
            let mut policy = example();
            policy.epsilon = value;
            let parsed = TaskPolicy::parse(&policy.encode()).unwrap();
            assert_eq!(parsed.epsilon.to_bits(), value.to_bits(), "{value}");
        }
    }

    #[test]
    fn non_canonical_or_malformed_texts_are_refused() {
        let text = example().encode();
        let cases = [
            ("other format", text.replace("policy/v3", "policy/v2")),
            (
                "v2 without a window",
                text.replace("policy/v3", "policy/v2")
                    .replace("upload_window=30000,90000\n", ""),
            ),
            (
                "window backwards",
                text.replace("upload_window=30000,90000", "upload_window=90000,30000"),
            ),
            (
                "decimal epsilon",
                text.replace("epsilon=4e0", "epsilon=4.0"),
            ),
            ("leading zero", text.replace("rounds=5", "rounds=05")),
            ("missing field", text.replace("delta=1e-6\n", "")),
            (
                "reordered",
                text.replace("rounds=5\nreport_goal=100", "report_goal=100\nrounds=5"),
            ),
            ("no final newline", text.trim_end().to_string()),
            ("extra line", format!("{text}x=1\n")),
            (
                "plan not an object",
                text.replace("plan={", "plan=[").replace("}\n", "]\n"),
            ),
            ("bad population", text.replace("phones.en", "phones/en")),
            ("nan", text.replace("clip_norm=1e0", "clip_norm=NaN")),
        ];
        for (case, bad) in cases {
            assert!(TaskPolicy::parse(&bad).is_err(), "{case} was accepted");
        }
    }

    #[test]
    fn the_hash_changes_with_every_field() {
        let base = example().sha256_hex();
        let changes: [fn(&mut TaskPolicy); 7] = [
            |p| p.upload_window.end_ms += 1,
            |p| p.epsilon = 4.000001,
            |p| p.clip_norm = 2.0,
            |p| p.rounds = 6,
            |p| p.min_reports = 59,
            |p| p.tenant_id = "other".into(),
            |p| p.plan = r#"{"epochs":2}"#.into(),
        ];
        for change in changes {
            let mut policy = example();
            change(&mut policy);
            assert_ne!(policy.sha256_hex(), base);
        }
    }

    #[test]
    fn enclave_limits_refuse_what_no_release_may_use() {
        assert!(example().check_enclave_limits().is_ok());
        let refusals: [fn(&mut TaskPolicy); 6] = [
            |p| p.epsilon = 101.0,
            |p| p.delta = 0.5,
            |p| p.clip_norm = 5e-324,
            |p| p.min_reports = 0,
            |p| p.rounds = 0,
            |p| p.mechanism = "laplace".into(),
        ];
        for refuse in refusals {
            let mut policy = example();
            refuse(&mut policy);
            assert!(policy.check_enclave_limits().is_err(), "{policy:?}");
        }
    }

    #[test]
    fn mechanisms_parse_only_in_canonical_form() {
        let tree = Mechanism::Tree { min_separation: 8 };
        assert_eq!(tree.encode(), "tree_aggregation_on_grid;min_separation=8");
        assert_eq!(Mechanism::parse(&tree.encode()), Ok(tree));
        assert_eq!(Mechanism::parse(MECHANISM), Ok(Mechanism::Gaussian));
        for bad in [
            "tree_aggregation_on_grid",
            "tree_aggregation_on_grid;min_separation=0",
            "tree_aggregation_on_grid;min_separation=08",
            "tree_aggregation_on_grid;min_separation=1025",
            "tree_aggregation_on_grid;min_separation=8;x=1",
            "laplace",
        ] {
            assert!(Mechanism::parse(bad).is_err(), "{bad} was accepted");
        }
        let mut policy = example();
        policy.mechanism = tree.encode();
        assert!(policy.check_enclave_limits().is_ok());
        assert_eq!(policy.mechanism(), Ok(tree));
    }

    #[test]
    fn adaptive_clipping_rides_on_either_noise_in_canonical_form() {
        let adaptive = AdaptiveClipping {
            target_quantile: 0.5,
            learning_rate: 0.2,
            count_stddev: 5.0,
        };
        for noise in [Mechanism::Gaussian, Mechanism::Tree { min_separation: 4 }] {
            let m = DpMechanism {
                adaptive_clipping: Some(adaptive),
                ..DpMechanism::plain(noise)
            };
            let text = m.encode();
            assert!(text.ends_with(";adaptive_clipping=5e-1,2e-1,5e0"), "{text}");
            assert_eq!(DpMechanism::parse(&text), Ok(m));
            assert_eq!(Mechanism::parse(&text), Ok(noise));
        }
        for bad in [
            "discrete_gaussian_on_grid;adaptive_clipping=0.5,2e-1,5e0",
            "discrete_gaussian_on_grid;adaptive_clipping=5e-1,2e-1",
            "discrete_gaussian_on_grid;adaptive_clipping=1e0,2e-1,5e0",
            "discrete_gaussian_on_grid;adaptive_clipping=5e-1,2e-1,0e0",
            "discrete_gaussian_on_grid;adaptive_clipping=5e-1,2e-1,4e-1",
            "discrete_gaussian_on_grid;adaptive_clipping=5e-1,2e-1,5e0;x",
            "laplace;adaptive_clipping=5e-1,2e-1,5e0",
        ] {
            assert!(DpMechanism::parse(bad).is_err(), "{bad} was accepted");
        }
        // The rule moves the clip norm toward the quantile: too many unclipped -> smaller.
        assert!(adaptive.next_clip_norm(1.0, 0.9) < 1.0);
        assert!(adaptive.next_clip_norm(1.0, 0.1) > 1.0);
        assert_eq!(adaptive.next_clip_norm(1.0, 0.5), 1.0);
    }

    #[test]
    fn evaluation_follows_the_other_parts_in_canonical_form_and_names_its_rounds() {
        let evaluation = Evaluation {
            every: 3,
            max_loss: 10.0,
            max_examples: 50,
            stddev: 25.0,
            on_demand: 2,
        };
        let m = DpMechanism {
            adaptive_clipping: Some(AdaptiveClipping {
                target_quantile: 0.5,
                learning_rate: 0.2,
                count_stddev: 5.0,
            }),
            evaluation: Some(evaluation),
            ..DpMechanism::plain(Mechanism::Tree { min_separation: 4 })
        };
        let text = m.encode();
        assert_eq!(
            text,
            "tree_aggregation_on_grid;min_separation=4;adaptive_clipping=5e-1,2e-1,5e0;evaluation=3,1e1,50,2.5e1,2"
        );
        assert_eq!(DpMechanism::parse(&text), Ok(m));
        let alone = DpMechanism {
            evaluation: Some(evaluation),
            ..DpMechanism::plain(Mechanism::Gaussian)
        };
        assert_eq!(DpMechanism::parse(&alone.encode()), Ok(alone));
        let evaluated: Vec<u64> = (0..=10).filter(|&r| evaluation.evaluates(r)).collect();
        assert_eq!(evaluated, [1, 4, 7, 10]);
        assert_eq!(evaluation.rounds_through(9), 3);
        assert_eq!(evaluation.rounds_through(0), 0);
        // On demand: at most 2, and only in rounds the schedule does not evaluate.
        assert_eq!(evaluation.on_demand_through(1), 0);
        assert_eq!(evaluation.on_demand_through(2), 1);
        assert_eq!(evaluation.on_demand_through(9), 2);
        let only_on_demand = Evaluation {
            every: 0,
            ..evaluation
        };
        assert!(!only_on_demand.evaluates(1));
        assert_eq!(only_on_demand.rounds_through(5), 0);
        assert_eq!(only_on_demand.on_demand_through(1), 1);
        for bad in [
            "discrete_gaussian_on_grid;evaluation=0,1e1,50,2.5e1,0",
            "discrete_gaussian_on_grid;evaluation=3,10,50,2.5e1,0",
            "discrete_gaussian_on_grid;evaluation=3,1e1,0,2.5e1,0",
            "discrete_gaussian_on_grid;evaluation=3,1e1,50,5e-1,0",
            "discrete_gaussian_on_grid;evaluation=3,0e0,50,2.5e1,0",
            "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1",
            "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,1001",
            "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,02",
            "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,0;evaluation=3,1e1,50,2.5e1,0",
            "discrete_gaussian_on_grid;evaluation=3,1e1,50,2.5e1,0;adaptive_clipping=5e-1,2e-1,5e0",
        ] {
            assert!(DpMechanism::parse(bad).is_err(), "{bad} was accepted");
        }
    }

    #[test]
    fn a_blt_policy_runs_at_most_its_round_limit_and_pins_one_key() {
        let mut policy = example();
        policy.mechanism =
            "blt_on_grid;min_separation=5;buffers=5e-1:2.5e-1;max_values=1000;lattice_bits=3"
                .into();
        policy.rounds = crate::blt_noise::MAX_BLT_ROUNDS;
        assert!(policy.check_enclave_limits().is_ok());
        let blt = policy.mechanism().unwrap();
        assert_eq!(blt.min_separation(), 5);
        assert_eq!([1, 7, 9999].map(|r| blt.key_scope(r)), [Some(0); 3]);
        policy.rounds += 1;
        let err = policy.check_enclave_limits().unwrap_err();
        assert!(
            format!("{err:?}").contains("BLT noise runs at most"),
            "{err:?}"
        );
    }

    #[test]
    fn a_tree_pins_one_key_per_tree_of_min_separation_rounds() {
        let tree = Mechanism::Tree { min_separation: 4 };
        let scopes: Vec<_> = (1..=9).map(|r| tree.key_scope(r).unwrap()).collect();
        assert_eq!(scopes, [0, 0, 0, 0, 1, 1, 1, 1, 2]);
        assert_eq!(Mechanism::Gaussian.key_scope(3), None);
    }

    #[test]
    fn device_limits_refuse_a_looser_policy_and_say_which_field() {
        let limits = DeviceLimits {
            max_epsilon: 8.0,
            max_delta: 1e-5,
            min_reports: 50,
        };
        assert!(limits.check(&example()).is_ok());
        let mut loose = example();
        loose.epsilon = 10.0;
        loose.min_reports = 10;
        let error = limits.check(&loose).unwrap_err().to_string();
        assert!(
            error.contains("epsilon 10") && error.contains("min_reports 10"),
            "{error}"
        );
    }
}
