//! The messages of the task assignment API (devices): check-in, assignment or retry window, and
//! the outcome report; JSON on the wire (`docs/protocol.md`, "Devices"). A check-in's public
//! attributes and their bounds are here too, so a device can check them before it sends.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::ids::Capability;
use crate::keys::DeviceKey;
use crate::states::AssignmentState;

/// A device attribute reported at check-in (public: the server checks constraints against it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum Attribute {
    Flag(bool),
    Number(f64),
    Text(String),
}

pub type Attributes = BTreeMap<String, Attribute>;

/// Most attributes one check-in may carry.
pub const MAX_ATTRIBUTES: usize = 32;
/// Longest attribute name, in bytes (A-Z a-z 0-9 . _ -).
pub const MAX_ATTRIBUTE_NAME_BYTES: usize = 64;
/// Longest text attribute value, in bytes.
pub const MAX_ATTRIBUTE_TEXT_BYTES: usize = 256;

/// Check the bounds above. Attributes are public matching data, not payloads: the bounds keep one
/// check-in's share of the recent-devices registry at a few KiB however large the body may be.
pub fn check_attributes(attributes: &Attributes) -> Result<(), String> {
    if attributes.len() > MAX_ATTRIBUTES {
        return Err(format!(
            "at most {MAX_ATTRIBUTES} attributes are accepted (got {})",
            attributes.len()
        ));
    }
    for (name, value) in attributes {
        let name_ok = !name.is_empty()
            && name.len() <= MAX_ATTRIBUTE_NAME_BYTES
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !name_ok {
            return Err(format!(
                "attribute names must be 1-{MAX_ATTRIBUTE_NAME_BYTES} of A-Z a-z 0-9 . _ - (got {:?})",
                name.chars().take(80).collect::<String>()
            ));
        }
        if let Attribute::Text(text) = value
            && text.len() > MAX_ATTRIBUTE_TEXT_BYTES
        {
            return Err(format!(
                "attribute {name:?} is {} bytes; text values may have at most {MAX_ATTRIBUTE_TEXT_BYTES}",
                text.len()
            ));
        }
    }
    Ok(())
}

#[cfg(feature = "openapi")]
/// The OpenAPI schema of `attributes`, with the bounds `check_attributes` enforces.
pub fn attributes_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, SchemaType, Type};
    let value = OneOfBuilder::new()
        .item(ObjectBuilder::new().schema_type(SchemaType::new(Type::Boolean)))
        .item(ObjectBuilder::new().schema_type(SchemaType::new(Type::Number)))
        .item(
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::String))
                .max_length(Some(MAX_ATTRIBUTE_TEXT_BYTES)),
        );
    ObjectBuilder::new()
        .schema_type(SchemaType::new(Type::Object))
        .description(Some(
            "Public attributes the server matches against task constraints (e.g. os, ram_gb, \
             charging): a boolean, a number or a string of at most 256 bytes each.",
        ))
        .max_properties(Some(MAX_ATTRIBUTES))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(SchemaType::new(Type::String))
                .pattern(Some("^[A-Za-z0-9._-]{1,64}$")),
        ))
        .additional_properties(Some(utoipa::openapi::schema::Schema::OneOf(value.build())))
        .build()
}

#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CheckinRequest {
    /// Dotted numeric version of the device's client, e.g. `"1.4.0"` (1-4 parts).
    #[cfg_attr(
        feature = "openapi",
        schema(pattern = r"^[0-9]{1,9}(\.[0-9]{1,9}){0,3}$")
    )]
    pub client_version: String,
    /// Public attributes the server matches against task constraints (e.g. os, ram_gb, charging):
    /// at most 32, names of 1-64 of A-Z a-z 0-9 . _ -, text values of at most 256 bytes.
    #[serde(default)]
    #[cfg_attr(feature = "openapi", schema(schema_with = attributes_schema))]
    pub attributes: Attributes,
    /// The tenant this device works for (optional): only that tenant's tasks are assigned, and
    /// a population registered to another tenant answers `tenant_mismatch`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 128))]
    pub tenant_id: Option<String>,
    /// The latest round this device served of each task (optional, at most 256): the server then
    /// does not assign it a round it would decline (the same round, or one closer than the task's
    /// minimum separation) and answers `min_separation` instead. Sending it tells the server
    /// which rounds this device served; a device may omit it and decline instead.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[cfg_attr(feature = "openapi", schema(max_items = 256))]
    pub served: Vec<ServedRound>,
}

/// Why a check-in request is refused before anything is looked up (400): the field and what to
/// send instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidCheckin(pub String);

/// Longest population name, in bytes (A-Z a-z 0-9 . _ -).
pub const MAX_POPULATION_BYTES: usize = 128;

/// Whether `population` is a population name: 1-128 of A-Z a-z 0-9 . _ -.
pub fn valid_population(population: &str) -> bool {
    (1..=MAX_POPULATION_BYTES).contains(&population.len())
        && population
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// Parses a dotted numeric version (`"1"`, `"1.4"`, `"2.0.1"`, at most 4 parts).
pub fn parse_version(text: &str) -> Option<Vec<u32>> {
    let parts: Option<Vec<u32>> = text.split('.').map(|p| p.parse().ok()).collect();
    parts.filter(|p| (1..=4).contains(&p.len()))
}

impl CheckinRequest {
    /// Checks a check-in to `population` against the bounds above and in `docs/protocol.md`
    /// (the server refuses what fails with 400 and this message; a device can check first), and
    /// returns the parsed `client_version`.
    pub fn validate(&self, population: &str) -> Result<Vec<u32>, InvalidCheckin> {
        let invalid = |message: String| Err(InvalidCheckin(message));
        if !valid_population(population) {
            return invalid("the population must be 1-128 of A-Z a-z 0-9 . _ -".into());
        }
        let Some(version) = parse_version(&self.client_version) else {
            return invalid(format!(
                "`client_version` must be a dotted numeric version like \"1.4.0\" (got {:?})",
                self.client_version
            ));
        };
        check_attributes(&self.attributes).map_err(InvalidCheckin)?;
        if self.served.len() > MAX_SERVED {
            return invalid(format!(
                "`served` lists {} rounds; send at most {MAX_SERVED} (the latest round of each task)",
                self.served.len(),
            ));
        }
        // Characters, as the schema's maxLength counts them (at most 512 bytes of UTF-8).
        if let Some(bad) = self
            .served
            .iter()
            .find(|s| !(1..=128).contains(&s.task_id.chars().count()))
        {
            return invalid(format!(
                "`served` names a task id of {} characters; task ids are 1-128",
                bad.task_id.chars().count()
            ));
        }
        if let Some(bad) = self
            .served
            .iter()
            .find(|s| !(1..=MAX_SERVED_ROUND).contains(&s.round))
        {
            return invalid(format!(
                "`served` names round {}; rounds are 1-{MAX_SERVED_ROUND}",
                bad.round,
            ));
        }
        if let Some(tenant) = &self.tenant_id
            && !(1..=128).contains(&tenant.chars().count())
        {
            return invalid(
                "`tenant_id` must be 1-128 characters (the id of the tenant the device works for)"
                    .into(),
            );
        }
        Ok(version)
    }
}

/// A round a device served.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ServedRound {
    #[cfg_attr(feature = "openapi", schema(min_length = 1, max_length = 128))]
    pub task_id: String,
    /// 1-10000 (a task's rounds); `6.0` is read as 6, as JSON Schema's `integer` means it.
    #[serde(deserialize_with = "integral")]
    #[cfg_attr(feature = "openapi", schema(minimum = 1, maximum = 10000))]
    pub round: i64,
}

/// Largest round a `served` entry may name (a task's rounds are at most this).
pub const MAX_SERVED_ROUND: i64 = 10_000;

/// A JSON integer as JSON Schema means it: `6.0` is 6, `6.5` is refused.
fn integral<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
    let number = serde_json::Number::deserialize(deserializer)?;
    if let Some(value) = number.as_i64() {
        return Ok(value);
    }
    match number.as_f64() {
        Some(value) if value.fract() == 0.0 && value.abs() < 9.007_199_254_740_992e15 => {
            Ok(value as i64)
        }
        _ => Err(serde::de::Error::custom(format!(
            "{number} is not an integer"
        ))),
    }
}

/// Most `served` entries a check-in may carry.
pub const MAX_SERVED: usize = 256;

/// A device's assignment (201). `Debug` leaves out the capability and every URL that carries it
/// (or a signed upload URL): printing an assignment never prints a secret.
#[derive(Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AssignmentResponse {
    /// One-time capability; keep it secret, use it in the URLs below.
    #[cfg_attr(feature = "openapi", schema(value_type = String))]
    pub assignment_id: Capability,
    pub task_id: String,
    pub round: i64,
    /// Unix seconds; uploads and reports after it are refused (410).
    pub expires_at: i64,
    #[cfg_attr(feature = "openapi", schema(value_type = Object))]
    pub plan: serde_json::Value,
    /// The task policy text (docs/protocol.md, "Task policy"): check it against your limits,
    /// train with its plan, and bind its SHA-256 into the contribution's associated data.
    pub policy: String,
    pub model_version: i64,
    /// Where to download the model (path relative to the server's base URL): readable while the
    /// assignment is live.
    pub model_url: String,
    /// The key to seal the update to, with the key services' signatures: use it only if at least
    /// T key services the device trusts signed it.
    pub encryption: DeviceKey,
    /// Where to PUT the envelope: a path on this server, or an absolute (signed) URL of the blob
    /// store when devices upload straight to it.
    pub upload_url: String,
    /// Send exactly these headers with the upload (a signed URL covers them).
    #[serde(default)]
    pub upload_headers: BTreeMap<String, String>,
    pub report_url: String,
    /// Largest envelope the upload accepts.
    pub max_contribution_bytes: u64,
    /// The partner asked to evaluate this round on demand: a device whose policy allows
    /// on-demand evaluations and that has not used them all adds its metrics (docs/protocol.md,
    /// "Evaluation"). Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub evaluate: bool,
}

impl std::fmt::Debug for AssignmentResponse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AssignmentResponse")
            .field("assignment_id", &self.assignment_id)
            .field("task_id", &self.task_id)
            .field("round", &self.round)
            .field("expires_at", &self.expires_at)
            .field("model_version", &self.model_version)
            .field("key_id", &self.encryption.key_id)
            .field("max_contribution_bytes", &self.max_contribution_bytes)
            .finish_non_exhaustive()
    }
}

/// When the device should ask again, and why nothing was assigned (200).
#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RetryResponse {
    pub retry_window: RetryWindow,
    /// `no_task`, `round_full`, `version_mismatch`, `constraints_not_met`, `tenant_mismatch`,
    /// `no_encryption_key` or `min_separation`.
    pub reason: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RetryWindow {
    pub min_seconds: u32,
    pub max_seconds: u32,
}

impl RetryWindow {
    /// How long to wait: uniformly inside the window, given `unit` drawn uniformly from [0, 1),
    /// so devices told to retry at the same moment do not come back together.
    pub fn jittered(&self, unit: f64) -> std::time::Duration {
        let (lo, hi) = (
            f64::from(self.min_seconds),
            f64::from(self.max_seconds.max(self.min_seconds)),
        );
        std::time::Duration::from_secs_f64(lo + (hi - lo) * unit.clamp(0.0, 1.0))
    }
}

/// How an assignment ended on the device. (Named `Outcome` in the OpenAPI document, as before
/// the protocol crate.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema), schema(as = Outcome))]
#[serde(rename_all = "snake_case")]
pub enum ReportOutcome {
    Completed,
    Failed,
    NotEligible,
}

#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    pub outcome: ReportOutcome,
    /// What went wrong, for `failed` (at most 1000 characters are kept).
    #[serde(default)]
    pub error: Option<String>,
}

#[derive(Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReportResponse {
    pub state: AssignmentState,
    /// For a `not_eligible` report: how long to wait before checking in again. The server cannot
    /// tell devices apart, so a device that declined (it already served the round) would
    /// otherwise be offered the same round at once, again and again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_window: Option<RetryWindow>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(json: serde_json::Value) -> CheckinRequest {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_check_in_within_the_bounds_validates_to_its_parsed_version() {
        let ok = request(serde_json::json!({
            "client_version": "1.10.0", "attributes": {"os": "android"},
            "tenant_id": "acme", "served": [{"task_id": "t", "round": 3}],
        }));
        assert_eq!(ok.validate("keyboard.en-US_1").unwrap(), vec![1, 10, 0]);
    }

    #[test]
    fn each_bound_of_a_check_in_is_refused_naming_its_field() {
        let valid = serde_json::json!({"client_version": "1.0"});
        let cases = [
            ("population", "bad population!", valid.clone()),
            (
                "client_version",
                "p",
                serde_json::json!({"client_version": "1.x"}),
            ),
            (
                "client_version",
                "p",
                serde_json::json!({"client_version": "1.2.3.4.5"}),
            ),
            (
                "attributes",
                "p",
                serde_json::json!({"client_version": "1", "attributes": {"bad name": 1}}),
            ),
            (
                "served",
                "p",
                serde_json::json!({"client_version": "1", "served": [{"task_id": "", "round": 1}]}),
            ),
            (
                "served",
                "p",
                serde_json::json!({"client_version": "1", "served": [{"task_id": "t", "round": 10001}]}),
            ),
            (
                "tenant_id",
                "p",
                serde_json::json!({"client_version": "1", "tenant_id": ""}),
            ),
        ];
        for (field, population, json) in cases {
            let refused = request(json.clone()).validate(population).unwrap_err().0;
            let named = if field == "attributes" {
                "attribute"
            } else {
                field
            };
            assert!(refused.contains(named), "{json}: {refused}");
        }
        let too_many: Vec<_> = (0..=MAX_SERVED)
            .map(|i| serde_json::json!({"task_id": format!("t{i}"), "round": 1}))
            .collect();
        let refused = request(serde_json::json!({"client_version": "1", "served": too_many}))
            .validate("p")
            .unwrap_err();
        assert!(refused.0.contains("at most"), "{refused}");
    }

    #[test]
    fn an_assignment_prints_without_its_capability_or_urls() {
        let secret = "capability-that-must-not-be-logged";
        let assignment: AssignmentResponse = serde_json::from_value(serde_json::json!({
            "assignment_id": secret, "task_id": "t1", "round": 1, "expires_at": 0,
            "plan": {}, "policy": "", "model_version": 0,
            "model_url": format!("/v1/assignments/{secret}/model"),
            "encryption": {"key_id": "k1", "suite": "", "public_key": "", "not_before": 0,
                           "not_after": 1, "threshold": 1, "shares": 1, "signatures": []},
            "upload_url": format!("https://storage.example/{secret}?X-Goog-Signature=abc"),
            "report_url": format!("/v1/assignments/{secret}/report"),
            "max_contribution_bytes": 1,
        }))
        .unwrap();
        let printed = format!("{assignment:?}");
        assert!(!printed.contains(secret), "{printed}");
        assert!(!printed.contains("Signature"), "{printed}");
        assert!(printed.contains("t1"), "{printed}");
    }
}
