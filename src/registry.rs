//! Recent devices: soft state, a sliding window of check-ins kept in memory (lost on restart by
//! design). It answers "how many devices checked in lately that this task would accept", so a
//! partner can see why a round fills slowly, and feeds metrics.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;

use crate::clock::Millis;
use crate::task_spec::{Constraint, TaskSpec, parse_version};

pub use confed_protocol::device::{
    Attribute, Attributes, MAX_ATTRIBUTE_NAME_BYTES, MAX_ATTRIBUTE_TEXT_BYTES, MAX_ATTRIBUTES,
    check_attributes,
};

/// Why a device's attributes or version do not fit a task.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mismatch {
    Version,
    Constraints,
}

/// Whether a device with `version` and `attributes` may work on a task.
pub fn fits(spec: &TaskSpec, version: &[u32], attributes: &Attributes) -> Result<(), Mismatch> {
    fits_with(spec, version, |name| attributes.get(name))
}

/// `fits`, with the device's attributes looked up by `get`.
fn fits_with<'a>(
    spec: &TaskSpec,
    version: &[u32],
    get: impl Fn(&str) -> Option<&'a Attribute>,
) -> Result<(), Mismatch> {
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
        let ok = match (constraint, get(name)) {
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

/// One check-in as the window keeps it: compact (exact-size boxes, attributes sorted by name
/// in one slice rather than a B-tree whose every node reserves room for eleven entries).
struct Seen {
    at: Millis,
    /// What the check-in came to: `assigned` or a retry reason (`RetryReason::as_str`).
    outcome: &'static str,
    population: Box<str>,
    version: Box<[u32]>,
    attributes: Box<[(Box<str>, Attribute)]>,
}

impl Seen {
    fn attribute(&self, name: &str) -> Option<&Attribute> {
        self.attributes
            .binary_search_by(|(key, _)| key.as_ref().cmp(name))
            .ok()
            .map(|at| &self.attributes[at].1)
    }

    /// What the entry costs, allocator overhead included (16 bytes per heap allocation): the
    /// registry's byte budget is counted with it, so it must not be under the truth.
    fn approx_bytes(&self) -> usize {
        const ALLOCATION: usize = 16;
        let heap = |len: usize| {
            if len == 0 {
                0
            } else {
                len.next_multiple_of(16) + ALLOCATION
            }
        };
        let attributes: usize = self
            .attributes
            .iter()
            .map(|(name, value)| {
                heap(name.len())
                    + match value {
                        Attribute::Text(text) => heap(text.len()),
                        _ => 0,
                    }
            })
            .sum();
        std::mem::size_of::<(Seen, usize)>()
            + heap(self.population.len())
            + heap(4 * self.version.len())
            + heap(std::mem::size_of::<(Box<str>, Attribute)>() * self.attributes.len())
            + attributes
    }
}

#[derive(Default)]
struct Window {
    entries: VecDeque<(Seen, usize)>,
    bytes: usize,
}

/// What one population's devices did lately (see `DeviceRegistry::activities`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PopulationActivity {
    pub checkins: u64,
    /// Check-ins per outcome: `assigned` or the retry reason devices were given.
    pub outcomes: BTreeMap<&'static str, u64>,
    /// Check-ins per minute of the window, oldest first.
    pub per_minute: Vec<u64>,
}

/// The sliding window of recent check-ins, bounded by count and by bytes.
pub struct DeviceRegistry {
    window_millis: i64,
    capacity: usize,
    byte_budget: usize,
    seen: Mutex<Window>,
}

impl std::fmt::Debug for DeviceRegistry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceRegistry")
            .field("window_millis", &self.window_millis)
            .finish_non_exhaustive()
    }
}

impl Default for DeviceRegistry {
    /// The last 15 minutes, at most 100,000 check-ins and 32 MiB.
    fn default() -> Self {
        Self::new(15 * 60 * 1000, 100_000, 32 << 20)
    }
}

impl DeviceRegistry {
    pub fn new(window_millis: i64, capacity: usize, byte_budget: usize) -> Self {
        Self {
            window_millis,
            capacity,
            byte_budget,
            seen: Mutex::new(Window::default()),
        }
    }

    /// Remembers one check-in and what it came to (`outcome`: `assigned` or a retry reason).
    pub fn record(
        &self,
        population: &str,
        version: Vec<u32>,
        attributes: Attributes,
        outcome: &'static str,
        now: Millis,
    ) {
        let entry = Seen {
            at: now,
            outcome,
            population: population.into(),
            version: version.into_boxed_slice(),
            // A BTreeMap iterates in key order: the slice is sorted for binary search.
            attributes: attributes
                .into_iter()
                .map(|(name, value)| (name.into_boxed_str(), value))
                .collect(),
        };
        let size = entry.approx_bytes();
        let Ok(mut window) = self.seen.lock() else {
            return;
        };
        // The oldest go first: past the window, past the count, or to make room in the budget.
        while let Some((front, front_size)) = window.entries.front() {
            let full =
                window.entries.len() >= self.capacity || window.bytes + size > self.byte_budget;
            if front.at > Millis(now.0 - self.window_millis) && !full {
                break;
            }
            window.bytes -= *front_size;
            window.entries.pop_front();
        }
        if size <= self.byte_budget {
            window.bytes += size;
            window.entries.push_back((entry, size));
        }
    }

    /// Bytes held now (by the estimate the budget is counted with).
    pub fn bytes(&self) -> usize {
        self.seen.lock().map(|w| w.bytes).unwrap_or(0)
    }

    /// Recent check-ins per population (for metrics).
    pub fn by_population(&self, now: Millis) -> BTreeMap<String, u64> {
        let mut counts = BTreeMap::new();
        if let Ok(window) = self.seen.lock() {
            for (s, _) in window
                .entries
                .iter()
                .filter(|(s, _)| s.at > Millis(now.0 - self.window_millis))
            {
                *counts.entry(s.population.to_string()).or_default() += 1;
            }
        }
        counts
    }

    /// Recent check-ins of each of `populations`: how many, what they came to, and how many per
    /// minute (oldest minute first), for the console's "why does my round fill slowly" view.
    /// One pass over the window, whatever the number of populations asked for.
    pub fn activities(
        &self,
        populations: &[&str],
        now: Millis,
    ) -> BTreeMap<String, PopulationActivity> {
        let minutes = usize::try_from(((self.window_millis + 59_999) / 60_000).max(1)).unwrap_or(1);
        let mut out: BTreeMap<String, PopulationActivity> = populations
            .iter()
            .map(|p| {
                let empty = PopulationActivity {
                    checkins: 0,
                    outcomes: BTreeMap::new(),
                    per_minute: vec![0; minutes],
                };
                (p.to_string(), empty)
            })
            .collect();
        let Ok(window) = self.seen.lock() else {
            return out;
        };
        for (seen, _) in window
            .entries
            .iter()
            .filter(|(s, _)| s.at > Millis(now.0 - self.window_millis))
        {
            let Some(activity) = out.get_mut(&*seen.population) else {
                continue;
            };
            activity.checkins += 1;
            *activity.outcomes.entry(seen.outcome).or_default() += 1;
            let minutes_ago = usize::try_from((now.0 - seen.at.0) / 60_000).unwrap_or(0);
            if let Some(bucket) = minutes.checked_sub(minutes_ago + 1) {
                activity.per_minute[bucket] += 1;
            }
        }
        out
    }

    /// Recent check-ins of the task's population that meet its version range and constraints.
    pub fn eligible(&self, spec: &TaskSpec, now: Millis) -> u64 {
        let Ok(window) = self.seen.lock() else {
            return 0;
        };
        window
            .entries
            .iter()
            .map(|(s, _)| s)
            .filter(|s| {
                s.at > Millis(now.0 - self.window_millis) && *s.population == *spec.population
            })
            .filter(|s| fits_with(spec, &s.version, |name| s.attribute(name)).is_ok())
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
        let registry = DeviceRegistry::new(1000, 10, 1 << 20);
        let task = spec(serde_json::json!({"constraints": {"charging": true}}));
        registry.record(
            "p",
            vec![1],
            attrs(serde_json::json!({"charging": true})),
            "assigned",
            Millis(0),
        );
        registry.record(
            "p",
            vec![1],
            attrs(serde_json::json!({"charging": false})),
            "constraints_not_met",
            Millis(500),
        );
        registry.record(
            "other",
            vec![1],
            attrs(serde_json::json!({"charging": true})),
            "assigned",
            Millis(500),
        );
        assert_eq!(registry.eligible(&task, Millis(900)), 1);
        assert_eq!(registry.by_population(Millis(900)).get("p"), Some(&2));
        assert_eq!(registry.eligible(&task, Millis(1500)), 0);
    }

    #[test]
    fn activity_counts_one_populations_outcomes_per_minute() {
        let registry = DeviceRegistry::new(3 * 60_000, 100, 1 << 20);
        let none = Attributes::new();
        registry.record("p", vec![1], none.clone(), "assigned", Millis(10_000));
        registry.record("p", vec![1], none.clone(), "round_full", Millis(130_000));
        registry.record("p", vec![1], none.clone(), "round_full", Millis(150_000));
        registry.record("q", vec![1], none.clone(), "assigned", Millis(150_000));
        let activities = registry.activities(&["p", "absent"], Millis(170_000));
        let activity = &activities["p"];
        assert_eq!(activities["absent"].checkins, 0);
        assert_eq!(activity.checkins, 3);
        assert_eq!(activity.outcomes.get("round_full"), Some(&2));
        assert_eq!(activity.outcomes.get("assigned"), Some(&1));
        // Minutes ago 2 (the first), 0 (the last two); oldest minute first.
        assert_eq!(activity.per_minute, vec![1, 0, 2]);
        // Past the window, the first is forgotten.
        assert_eq!(
            registry.activities(&["p"], Millis(200_000))["p"].checkins,
            2
        );
    }

    #[test]
    fn registry_is_bounded_by_bytes_not_only_by_count() {
        let budget = 64 * 1024;
        let registry = DeviceRegistry::new(60_000, 100_000, budget);
        let big: Attributes = (0..MAX_ATTRIBUTES)
            .map(|i| {
                (
                    format!("{i:064}"),
                    Attribute::Text("x".repeat(MAX_ATTRIBUTE_TEXT_BYTES)),
                )
            })
            .collect();
        check_attributes(&big).unwrap();
        for i in 0..1_000 {
            registry.record("p", vec![1], big.clone(), "assigned", Millis(i));
        }
        assert!(
            registry.bytes() <= budget,
            "{} > {budget}",
            registry.bytes()
        );
        let kept = registry.by_population(Millis(1_000))["p"];
        assert!(
            (1..1_000).contains(&kept),
            "the oldest were evicted: kept {kept}"
        );
    }

    #[test]
    fn oversized_attribute_maps_are_refused() {
        let too_many: Attributes = (0..=MAX_ATTRIBUTES)
            .map(|i| (format!("a{i}"), Attribute::Flag(true)))
            .collect();
        assert!(
            check_attributes(&too_many)
                .unwrap_err()
                .contains("at most 32")
        );
        let long_name = attrs(serde_json::json!({ "n".repeat(65): true }));
        assert!(check_attributes(&long_name).is_err());
        let bad_name = attrs(serde_json::json!({"os name": "x"}));
        assert!(check_attributes(&bad_name).is_err());
        let long_text = attrs(serde_json::json!({"os": "x".repeat(257)}));
        assert!(
            check_attributes(&long_text)
                .unwrap_err()
                .contains("257 bytes")
        );
        let fine = attrs(serde_json::json!({"os": "x".repeat(256), "ram_gb": 8, "charging": true}));
        assert_eq!(check_attributes(&fine), Ok(()));
    }
}
