//! Recent devices: soft state, a sliding window of check-ins kept in memory (lost on restart by
//! design). It answers "how many devices checked in lately that this task would accept", so a
//! partner can see why a round fills slowly, and feeds metrics.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use serde::Deserialize;
use utoipa::ToSchema;

use crate::clock::Millis;
use crate::task_spec::{Constraint, TaskSpec, parse_version};

/// A device attribute reported at check-in (public: the server checks constraints against it).
#[derive(Debug, Clone, PartialEq, Deserialize, ToSchema)]
#[serde(untagged)]
pub enum Attribute {
    Flag(bool),
    Number(f64),
    Text(String),
}

pub type Attributes = BTreeMap<String, Attribute>;

/// Why a device's attributes or version do not fit a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    Version,
    Constraints,
}

/// Whether a device with `version` and `attributes` may work on a task.
pub fn fits(spec: &TaskSpec, version: &[u32], attributes: &Attributes) -> Result<(), Mismatch> {
    if let Some(range) = &spec.client_version {
        let below = range
            .min
            .as_deref()
            .and_then(parse_version)
            .is_some_and(|min| version < min.as_slice());
        let above = range
            .max
            .as_deref()
            .and_then(parse_version)
            .is_some_and(|max| version > max.as_slice());
        if below || above {
            return Err(Mismatch::Version);
        }
    }
    for (name, constraint) in &spec.constraints {
        let ok = match (constraint, attributes.get(name)) {
            (Constraint::Flag(want), Some(Attribute::Flag(have))) => want == have,
            (Constraint::Text(want), Some(Attribute::Text(have))) => want == have,
            (Constraint::Range(range), Some(Attribute::Number(have))) => {
                range.min.is_none_or(|min| *have >= min) && range.max.is_none_or(|max| *have <= max)
            }
            _ => false,
        };
        if !ok {
            return Err(Mismatch::Constraints);
        }
    }
    Ok(())
}

struct Seen {
    at: Millis,
    population: String,
    version: Vec<u32>,
    attributes: Attributes,
}

/// The sliding window of recent check-ins.
pub struct DeviceRegistry {
    window_millis: i64,
    capacity: usize,
    seen: Mutex<VecDeque<Seen>>,
}

impl std::fmt::Debug for DeviceRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegistry")
            .field("window_millis", &self.window_millis)
            .finish_non_exhaustive()
    }
}

impl Default for DeviceRegistry {
    /// The last 15 minutes, at most 100,000 check-ins.
    fn default() -> Self {
        Self::new(15 * 60 * 1000, 100_000)
    }
}

impl DeviceRegistry {
    pub fn new(window_millis: i64, capacity: usize) -> Self {
        Self {
            window_millis,
            capacity,
            seen: Mutex::new(VecDeque::new()),
        }
    }

    pub fn record(&self, population: &str, version: Vec<u32>, attributes: Attributes, now: Millis) {
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        while seen
            .front()
            .is_some_and(|s| s.at <= now - self.window_millis)
            || seen.len() >= self.capacity
        {
            seen.pop_front();
        }
        seen.push_back(Seen {
            at: now,
            population: population.to_string(),
            version,
            attributes,
        });
    }

    /// Recent check-ins per population (for metrics).
    pub fn by_population(&self, now: Millis) -> BTreeMap<String, u64> {
        let mut counts = BTreeMap::new();
        if let Ok(seen) = self.seen.lock() {
            for s in seen.iter().filter(|s| s.at > now - self.window_millis) {
                *counts.entry(s.population.clone()).or_default() += 1;
            }
        }
        counts
    }

    /// Recent check-ins of the task's population that meet its version range and constraints.
    pub fn eligible(&self, spec: &TaskSpec, now: Millis) -> u64 {
        let Ok(seen) = self.seen.lock() else { return 0 };
        seen.iter()
            .filter(|s| s.at > now - self.window_millis && s.population == spec.population)
            .filter(|s| fits(spec, &s.version, &s.attributes).is_ok())
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::task_spec::CreateTaskRequest;

    fn spec(extra: serde_json::Value) -> TaskSpec {
        let mut body = serde_json::json!({
            "population": "p", "rounds": 1, "report_goal": 10,
            "privacy": {"epsilon": 1.0, "delta": 1e-6, "clip_norm": 1.0},
        });
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        serde_json::from_value::<CreateTaskRequest>(body)
            .unwrap()
            .validate()
            .unwrap()
    }

    fn attrs(value: serde_json::Value) -> Attributes {
        serde_json::from_value(value).unwrap()
    }

    #[test]
    fn versions_and_constraints_decide_fit() {
        let task = spec(serde_json::json!({
            "client_version": {"min": "1.2", "max": "2"},
            "constraints": {"os": "android", "charging": true, "ram_gb": {"min": 4}},
        }));
        let good = attrs(serde_json::json!({"os": "android", "charging": true, "ram_gb": 8}));
        assert_eq!(fits(&task, &[1, 4], &good), Ok(()));
        assert_eq!(fits(&task, &[1, 1], &good), Err(Mismatch::Version));
        assert_eq!(fits(&task, &[2, 0, 1], &good), Err(Mismatch::Version));
        for bad in [
            serde_json::json!({"os": "ios", "charging": true, "ram_gb": 8}),
            serde_json::json!({"os": "android", "charging": false, "ram_gb": 8}),
            serde_json::json!({"os": "android", "charging": true, "ram_gb": 2}),
            serde_json::json!({"os": "android", "charging": true}),
            serde_json::json!({"os": "android", "charging": "yes", "ram_gb": 8}),
        ] {
            assert_eq!(
                fits(&task, &[1, 4], &attrs(bad.clone())),
                Err(Mismatch::Constraints),
                "{bad}"
            );
        }
    }

    #[test]
    fn window_forgets_old_check_ins() {
        let registry = DeviceRegistry::new(1000, 10);
        let task = spec(serde_json::json!({"constraints": {"charging": true}}));
        registry.record(
            "p",
            vec![1],
            attrs(serde_json::json!({"charging": true})),
            0,
        );
        registry.record(
            "p",
            vec![1],
            attrs(serde_json::json!({"charging": false})),
            500,
        );
        registry.record(
            "other",
            vec![1],
            attrs(serde_json::json!({"charging": true})),
            500,
        );
        assert_eq!(registry.eligible(&task, 900), 1);
        assert_eq!(registry.by_population(900).get("p"), Some(&2));
        assert_eq!(registry.eligible(&task, 1500), 0);
    }
}
