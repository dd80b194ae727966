//! A task policy's analytics query (`analytics=` line, `policy.rs`; docs/analytics.md): what an
//! analytics task asks of devices, and the per-device bounds the device applies and the enclave
//! enforces again. Devices bind it with the rest of the policy, so nobody can widen a query after
//! devices agreed to it, and the key services' ledgers see it in every release commitment.
//!
//! ```text
//! analytics=histogram;domain_size=<u32>;keys_per_device=<u32>;max_value=<u64>
//! analytics=open_histogram;max_key_bytes=<u32>;keys_per_device=<u32>
//! analytics=quantiles;min=<f64>;max=<f64>;ranks=<f64>[,<f64>...];values_per_device=<u32>
//! ```
//!
//! Fields in exactly this order, numbers in the policy's canonical forms (integers decimal
//! without sign or leading zeros; reals Rust's `{:e}`). The same query as JSON (the task
//! definition's `analytics` object) is this type's serde form, tagged by `query`.

use serde::{Deserialize, Serialize};

/// Most keys a closed-domain histogram may declare (its dense sum is 8 bytes per key: 32 MiB).
pub const MAX_DOMAIN_SIZE: u32 = 1 << 22;
/// Most keys (or values) one device may contribute: the L0 bound and the padded length of
/// every contribution.
pub const MAX_KEYS_PER_DEVICE: u32 = 64;
/// Longest open-domain key, in bytes of UTF-8.
pub const MAX_KEY_BYTES: u32 = 64;
/// Largest value one device may add to one key of a `sums` histogram (integer units).
pub const MAX_VALUE: u64 = 1 << 20;
/// Most ranks a quantiles query may ask for.
pub const MAX_RANKS: usize = 16;
/// Largest magnitude of a quantiles query's bounds.
pub const MAX_QUANTILE_BOUND: f64 = 1e15;
/// The quantile tree: `QUANTILE_BRANCHING^QUANTILE_LEVELS` leaves (65,536) under a tree of
/// branching factor 16 and height 4, Google's quantile-tree defaults.
pub const QUANTILE_BRANCHING: u32 = 16;
pub const QUANTILE_LEVELS: u32 = 4;

/// One query (docs/analytics.md, "What a partner can ask").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "query", rename_all = "snake_case", deny_unknown_fields)]
pub enum AnalyticsQuery {
    /// A histogram over the closed domain of keys `0..domain_size`: every key is released,
    /// noised. A device adds up to `max_value` to each of up to `keys_per_device` distinct
    /// keys (`max_value` 1: counts).
    Histogram {
        domain_size: u32,
        keys_per_device: u32,
        #[serde(default = "one")]
        max_value: u64,
    },
    /// A count of devices per string over an open domain: a device adds 1 to each of up to
    /// `keys_per_device` distinct strings of at most `max_key_bytes` bytes; only keys whose
    /// noised count reaches the round's threshold are released (partition selection).
    OpenHistogram {
        max_key_bytes: u32,
        keys_per_device: u32,
    },
    /// Quantiles at `ranks` of a number in `[min, max]`, read from a noised hierarchical
    /// histogram; a device contributes up to `values_per_device` values.
    Quantiles {
        min: f64,
        max: f64,
        ranks: Vec<f64>,
        values_per_device: u32,
    },
}

fn one() -> u64 {
    1
}

/// One problem of a query: the field (as named in the task definition) and what is allowed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueryProblem {
    pub field: &'static str,
    pub reason: String,
}

impl AnalyticsQuery {
    /// The name of the query (the line's first field, the JSON's `query`).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Histogram { .. } => "histogram",
            Self::OpenHistogram { .. } => "open_histogram",
            Self::Quantiles { .. } => "quantiles",
        }
    }

    /// Every bound outside the caps of this build, each with what to change.
    pub fn problems(&self) -> Vec<QueryProblem> {
        let mut problems = Vec::new();
        let mut add = |field: &'static str, reason: String| {
            problems.push(QueryProblem { field, reason });
        };
        let per_device = |field, value: u32, add: &mut dyn FnMut(&'static str, String)| {
            if !(1..=MAX_KEYS_PER_DEVICE).contains(&value) {
                add(
                    field,
                    format!("must be between 1 and {MAX_KEYS_PER_DEVICE} (got {value})"),
                );
            }
        };
        match self {
            Self::Histogram {
                domain_size,
                keys_per_device,
                max_value,
            } => {
                if !(1..=MAX_DOMAIN_SIZE).contains(domain_size) {
                    add(
                        "domain_size",
                        format!(
                            "must be between 1 and {MAX_DOMAIN_SIZE} (got {domain_size}); a larger domain is an open_histogram"
                        ),
                    );
                }
                per_device("keys_per_device", *keys_per_device, &mut add);
                if !(1..=MAX_VALUE).contains(max_value) {
                    add(
                        "max_value",
                        format!(
                            "must be between 1 and {MAX_VALUE} (got {max_value}); scale the values to integer units in that range"
                        ),
                    );
                }
            }
            Self::OpenHistogram {
                max_key_bytes,
                keys_per_device,
            } => {
                if !(1..=MAX_KEY_BYTES).contains(max_key_bytes) {
                    add(
                        "max_key_bytes",
                        format!("must be between 1 and {MAX_KEY_BYTES} (got {max_key_bytes})"),
                    );
                }
                per_device("keys_per_device", *keys_per_device, &mut add);
            }
            Self::Quantiles {
                min,
                max,
                ranks,
                values_per_device,
            } => {
                let bounded = |v: &f64| v.is_finite() && v.abs() <= MAX_QUANTILE_BOUND;
                if !(bounded(min) && bounded(max) && min < max) {
                    add(
                        "min",
                        format!(
                            "min and max must be finite, at most {MAX_QUANTILE_BOUND:e} in magnitude, with min < max (got {min}, {max})"
                        ),
                    );
                }
                let increasing = ranks.windows(2).all(|w| w[0] < w[1]);
                let inside = ranks.iter().all(|r| *r > 0.0 && *r < 1.0);
                if ranks.is_empty() || ranks.len() > MAX_RANKS || !increasing || !inside {
                    add(
                        "ranks",
                        format!(
                            "give 1 to {MAX_RANKS} ranks in (0, 1), increasing (got {ranks:?})"
                        ),
                    );
                }
                per_device("values_per_device", *values_per_device, &mut add);
            }
        }
        problems
    }

    /// The L0 bound: most keys one device changes (a quantile value changes one node per level).
    pub fn keys_changed(&self) -> u32 {
        match self {
            Self::Quantiles { .. } => self.slots().saturating_mul(QUANTILE_LEVELS),
            _ => self.slots(),
        }
    }

    /// Slots in one answer (`keys_per_device`, or `values_per_device` for quantiles): the
    /// answer's fixed length (`answer.rs`).
    pub fn slots(&self) -> u32 {
        match self {
            Self::Histogram {
                keys_per_device, ..
            }
            | Self::OpenHistogram {
                keys_per_device, ..
            } => *keys_per_device,
            Self::Quantiles {
                values_per_device, ..
            } => *values_per_device,
        }
    }

    /// The most one slot of an answer may add to its key: `max_value` for a histogram, 1 for an
    /// open domain's key and for a quantile value (whose slots may share a leaf).
    pub fn slot_bound(&self) -> u64 {
        match self {
            Self::Histogram { max_value, .. } => *max_value,
            Self::OpenHistogram { .. } | Self::Quantiles { .. } => 1,
        }
    }

    /// The L-infinity bound: most one device changes one key (all its quantile values in one
    /// leaf add `values_per_device` to each node on its path).
    pub fn largest_change(&self) -> u64 {
        match self {
            Self::Histogram { max_value, .. } => *max_value,
            Self::OpenHistogram { .. } => 1,
            Self::Quantiles {
                values_per_device, ..
            } => u64::from(*values_per_device),
        }
    }

    /// The squared L2 sensitivity of one round's release, an integer: `k c^2` for histograms,
    /// `levels v^2` for quantiles (a device's `v` values change each level by `v` in all, at
    /// most all on one node).
    pub fn squared_sensitivity(&self) -> u128 {
        let c = u128::from(self.largest_change());
        let terms = match self {
            Self::Quantiles { .. } => QUANTILE_LEVELS,
            _ => self.slots(),
        };
        u128::from(terms) * c * c
    }

    /// Whether released keys are chosen by a threshold (open domains).
    pub fn has_threshold(&self) -> bool {
        matches!(self, Self::OpenHistogram { .. })
    }

    /// The value of the `analytics=` line.
    pub fn encode(&self) -> String {
        match self {
            Self::Histogram {
                domain_size,
                keys_per_device,
                max_value,
            } => format!(
                "histogram;domain_size={domain_size};keys_per_device={keys_per_device};max_value={max_value}"
            ),
            Self::OpenHistogram {
                max_key_bytes,
                keys_per_device,
            } => format!(
                "open_histogram;max_key_bytes={max_key_bytes};keys_per_device={keys_per_device}"
            ),
            Self::Quantiles {
                min,
                max,
                ranks,
                values_per_device,
            } => {
                let ranks: Vec<String> = ranks.iter().map(|r| format!("{r:e}")).collect();
                format!(
                    "quantiles;min={min:e};max={max:e};ranks={};values_per_device={values_per_device}",
                    ranks.join(",")
                )
            }
        }
    }

    /// Parses the value of an `analytics=` line strictly: the fields of its query in order,
    /// canonical numbers, and bounds within this build's caps.
    pub fn parse(value: &str) -> Result<Self, String> {
        let mut parts = value.split(';');
        let kind = parts.next().unwrap_or_default();
        let names: &[&str] = match kind {
            "histogram" => &["domain_size", "keys_per_device", "max_value"],
            "open_histogram" => &["max_key_bytes", "keys_per_device"],
            "quantiles" => &["min", "max", "ranks", "values_per_device"],
            other => {
                return Err(format!(
                    "`analytics` names an unknown query {other:?} (histogram, open_histogram or quantiles)"
                ));
            }
        };
        let mut values = Vec::with_capacity(names.len());
        for name in names {
            let part = parts
                .next()
                .ok_or_else(|| format!("`analytics={kind}` needs `{name}=`"))?;
            let field = part
                .strip_prefix(name)
                .and_then(|rest| rest.strip_prefix('='))
                .ok_or_else(|| format!("`analytics={kind}`: expected `{name}=` at {part:?}"))?;
            values.push(field);
        }
        if parts.next().is_some() {
            return Err(format!(
                "`analytics={kind}` has fields after `{}`",
                names[names.len() - 1]
            ));
        }
        let integer = |i: usize| -> Result<u64, String> {
            values[i]
                .parse::<u64>()
                .map_err(|_| format!("`{}` must be an unsigned integer", names[i]))
        };
        let small = |i: usize| -> Result<u32, String> {
            u32::try_from(integer(i)?).map_err(|_| format!("`{}` is too large", names[i]))
        };
        let real = |text: &str, name: &str| -> Result<f64, String> {
            text.parse::<f64>()
                .ok()
                .filter(|v| v.is_finite())
                .ok_or_else(|| format!("`{name}` must be a finite number"))
        };
        let query = match kind {
            "histogram" => Self::Histogram {
                domain_size: small(0)?,
                keys_per_device: small(1)?,
                max_value: integer(2)?,
            },
            "open_histogram" => Self::OpenHistogram {
                max_key_bytes: small(0)?,
                keys_per_device: small(1)?,
            },
            _ => Self::Quantiles {
                min: real(values[0], "min")?,
                max: real(values[1], "max")?,
                ranks: values[2]
                    .split(',')
                    .map(|r| real(r, "ranks"))
                    .collect::<Result<_, _>>()?,
                values_per_device: small(3)?,
            },
        };
        if query.encode() != value {
            return Err(
                "`analytics` is not in canonical form (integers without leading zeros, reals as `{:e}`)"
                    .into(),
            );
        }
        let problems = query.problems();
        if let Some(first) = problems.first() {
            return Err(format!("`analytics`: {}: {}", first.field, first.reason));
        }
        Ok(query)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> Vec<AnalyticsQuery> {
        vec![
            AnalyticsQuery::Histogram {
                domain_size: 1 << 20,
                keys_per_device: 16,
                max_value: 1,
            },
            AnalyticsQuery::Histogram {
                domain_size: 10,
                keys_per_device: 1,
                max_value: 600,
            },
            AnalyticsQuery::OpenHistogram {
                max_key_bytes: 32,
                keys_per_device: 16,
            },
            AnalyticsQuery::Quantiles {
                min: 0.0,
                max: 3600.0,
                ranks: vec![0.5, 0.9, 0.99],
                values_per_device: 1,
            },
        ]
    }

    #[test]
    fn every_query_encodes_and_parses_back_to_itself() {
        for query in samples() {
            let line = query.encode();
            assert_eq!(AnalyticsQuery::parse(&line), Ok(query.clone()), "{line}");
        }
        assert_eq!(
            samples()[3].encode(),
            "quantiles;min=0e0;max=3.6e3;ranks=5e-1,9e-1,9.9e-1;values_per_device=1"
        );
    }

    #[test]
    fn a_line_out_of_order_not_canonical_or_past_the_caps_is_refused() {
        for bad in [
            "histogram;keys_per_device=16;domain_size=10;max_value=1",
            "histogram;domain_size=010;keys_per_device=16;max_value=1",
            "histogram;domain_size=10;keys_per_device=16",
            "histogram;domain_size=10;keys_per_device=16;max_value=1;extra=1",
            "histogram;domain_size=10;keys_per_device=65;max_value=1",
            "histogram;domain_size=4194305;keys_per_device=1;max_value=1",
            "open_histogram;max_key_bytes=65;keys_per_device=1",
            "quantiles;min=0e0;max=3600;ranks=5e-1;values_per_device=1",
            "quantiles;min=1e0;max=0e0;ranks=5e-1;values_per_device=1",
            "quantiles;min=0e0;max=1e0;ranks=9e-1,5e-1;values_per_device=1",
            "quantiles;min=0e0;max=1e0;ranks=1e0;values_per_device=1",
            "sql;select=1",
        ] {
            assert!(AnalyticsQuery::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_json_form_is_tagged_by_query_and_refuses_unknown_fields() {
        let query: AnalyticsQuery = serde_json::from_str(
            r#"{"query": "histogram", "domain_size": 100, "keys_per_device": 4}"#,
        )
        .unwrap();
        assert_eq!(
            query,
            AnalyticsQuery::Histogram {
                domain_size: 100,
                keys_per_device: 4,
                max_value: 1
            }
        );
        assert!(
            serde_json::from_str::<AnalyticsQuery>(
                r#"{"query": "open_histogram", "max_key_bytes": 8, "keys_per_device": 4, "buckets": 2}"#
            )
            .is_err()
        );
    }

    #[test]
    fn sensitivities_follow_the_bounds() {
        let [histogram, sums, open, quantiles] = samples().try_into().unwrap();
        assert_eq!(histogram.squared_sensitivity(), 16);
        assert_eq!(sums.squared_sensitivity(), 600 * 600);
        assert_eq!(open.squared_sensitivity(), 16);
        assert!(open.has_threshold() && !histogram.has_threshold());
        // One value: one node on each of the 4 levels, sqrt(4) = 2.
        assert_eq!(quantiles.squared_sensitivity(), 4);
        assert_eq!(quantiles.keys_changed(), 4);
    }
}
