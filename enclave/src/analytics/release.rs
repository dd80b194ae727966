//! An analytics round's one release: every value of the exact table noised with the discrete
//! Gaussian the plan calibrated (keyed like training's noise, under its own label, so the same
//! inputs give the same bytes and any other inputs independent noise), an open domain's keys
//! selected by the threshold, the quantiles read from the noised tree, and the result written as
//! the release's bytes (`confed-analytics-release/v1` JSON, docs/protocol.md) with its manifest.

use rand_chacha::ChaCha12Rng;
use rand_core::SeedableRng;
use serde::Serialize;
use sha2::{Digest, Sha256};

use confed_dp::analytics::{AnalyticsPlan, OPEN_KEYS_CHECKED_AT, plan_analytics};
use confed_protocol::analytics::{AnalyticsQuery, QUANTILE_BRANCHING, QUANTILE_LEVELS};
use confed_protocol::policy::TaskPolicy;
use confed_worker_api::manifest::{AnalyticsRecord, NoiseRecord, PrivacyRecord};

use super::AnalyticsAggregator;
use super::table::{Table, level_start};
use crate::aggregate::noise::{self, NoiseBinding};
use crate::aggregate::{AggregateError, Manifest, digest, hex, manifest};
use crate::dp::{DiscreteGaussian, OpenDp};
use crate::hpke::PrivateKey;

/// The release's format.
pub const RESULT_FORMAT: &str = "confed-analytics-release/v1";

/// What an analytics round releases under: the policy's query and budget, and its plan.
#[derive(Debug, Clone)]
pub struct AnalyticsParams {
    pub query: AnalyticsQuery,
    pub epsilon: f64,
    pub delta: f64,
    pub rounds: u32,
    pub min_reports: u32,
    pub plan: AnalyticsPlan,
}

impl AnalyticsParams {
    /// The parameters of an analytics policy (`None` for a training one), planned with OpenDP's
    /// accountant as every release is.
    pub fn for_policy(policy: &TaskPolicy) -> Result<Option<Self>, AggregateError> {
        let Some(query) = policy.analytics.clone() else {
            return Ok(None);
        };
        let plan = plan_analytics(&OpenDp, &query, policy.epsilon, policy.delta, policy.rounds)?;
        Ok(Some(Self {
            query,
            epsilon: policy.epsilon,
            delta: policy.delta,
            rounds: policy.rounds,
            min_reports: policy.min_reports,
            plan,
        }))
    }
}

/// The result and its manifest: what may leave the enclave.
pub struct AnalyticsRelease {
    /// `confed-analytics-release/v1` JSON: what the manifest's `average_sha256` names.
    pub result: Vec<u8>,
    pub manifest: Manifest,
}

#[derive(Serialize)]
struct Quantile {
    rank: f64,
    value: f64,
}

/// The released result (docs/protocol.md, "Analytics results"). Noised values are integers.
#[derive(Serialize)]
struct Result_<'a> {
    format: &'static str,
    task_id: &'a str,
    round: u64,
    query: String,
    included: u64,
    noise_stddev: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    threshold: Option<u64>,
    /// A closed domain: the noised value of every key, in key order.
    #[serde(skip_serializing_if = "Option::is_none")]
    histogram: Option<Vec<i64>>,
    /// An open domain: the keys whose noised count reached the threshold, with it, by key bytes.
    #[serde(skip_serializing_if = "Option::is_none")]
    keys: Option<Vec<(String, i64)>>,
    /// Quantiles: the noised tree level by level (16, 256, 4096, 65536 nodes), and the
    /// quantiles read from it.
    #[serde(skip_serializing_if = "Option::is_none")]
    tree: Option<Vec<Vec<i64>>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    quantiles: Option<Vec<Quantile>>,
}

/// Labels of the two noises' keys (`noise::labelled_seed`).
const VALUES_LABEL: &[u8] = b"confed/dp-analytics-values/v1";
const DISTINCT_LABEL: &[u8] = b"confed/dp-analytics-distinct/v1";

impl AnalyticsAggregator {
    /// Noises the table once and releases the result. The noise is keyed from `private_key` and
    /// everything the release depends on (the binding's context and inputs digest).
    pub fn finish(
        self,
        private_key: &PrivateKey,
        params: &AnalyticsParams,
    ) -> Result<AnalyticsRelease, AggregateError> {
        let outcome = std::mem::take(&mut *self.outcome.lock().expect("analytics outcome"))
            .releasable(params.min_reports)?;
        let count = outcome.included.len() as u64;
        let plan = &params.plan;
        let noise = DiscreteGaussian::with_variance(plan.variance);
        let binding = NoiseBinding {
            context: &self.binding.context,
            inputs_digest: &self.binding.inputs_digest,
        };
        let seed = noise::labelled_seed(VALUES_LABEL, private_key, &binding);
        let mut record = AnalyticsRecord {
            query: params.query.encode(),
            sensitivity: plan.sensitivity(),
            noise_variance: plan.variance,
            noise_stddev: noise.scale(),
            threshold: plan.threshold.map(|t| t.tau),
            threshold_delta: plan
                .threshold
                .map(|t| t.delta_per_round + plan.distinct_check.map_or(0.0, |c| c.delta)),
            distinct_keys: None,
            distinct_keys_stddev: None,
            released_keys: None,
        };
        let mut result = Result_ {
            format: RESULT_FORMAT,
            task_id: &self.binding.context.task_id,
            round: self.binding.context.round,
            query: params.query.encode(),
            included: count,
            noise_stddev: noise.scale(),
            threshold: record.threshold,
            histogram: None,
            keys: None,
            tree: None,
            quantiles: None,
        };
        match &params.query {
            AnalyticsQuery::Histogram { .. } => {
                let mut values = signed(dense(self.table)?);
                noise::add(&mut values, &noise, &seed);
                result.histogram = Some(values);
            }
            AnalyticsQuery::Quantiles {
                min, max, ranks, ..
            } => {
                let mut values = signed(dense(self.table)?);
                noise::add(&mut values, &noise, &seed);
                let levels: Vec<Vec<i64>> = (1..=QUANTILE_LEVELS)
                    .map(|level| {
                        let start = level_start(level);
                        let len = (QUANTILE_BRANCHING as usize).pow(level);
                        values[start..start + len].to_vec()
                    })
                    .collect();
                result.quantiles = Some(
                    ranks
                        .iter()
                        .map(|rank| Quantile {
                            rank: *rank,
                            value: quantile(&levels, *min, *max, *rank),
                        })
                        .collect(),
                );
                result.tree = Some(levels);
            }
            AnalyticsQuery::OpenHistogram { .. } => {
                let (entries, full) = self.table.into_open().ok_or_else(mismatch)?;
                let check = plan.distinct_check.ok_or_else(mismatch)?;
                let threshold = plan.threshold.ok_or_else(mismatch)?;
                let distinct_seed = noise::labelled_seed(DISTINCT_LABEL, private_key, &binding);
                let mut rng = ChaCha12Rng::from_seed(*distinct_seed);
                let noised_distinct = i64::try_from(entries.len()).unwrap_or(i64::MAX)
                    + DiscreteGaussian::with_variance(check.variance).sample(&mut rng);
                // A full table refuses the round with the same words and a noised count as the
                // check does: which of the two stopped it is not said (the check's delta covers
                // a full table whose noised count would have passed).
                if full || noised_distinct > OPEN_KEYS_CHECKED_AT as i64 {
                    return Err(AggregateError::TooManyKeys {
                        noised: noised_distinct,
                        limit: OPEN_KEYS_CHECKED_AT,
                    });
                }
                let mut values: Vec<i64> = entries.iter().map(|(_, c)| *c as i64).collect();
                noise::add(&mut values, &noise, &seed);
                let tau = i64::try_from(threshold.tau).unwrap_or(i64::MAX);
                let released: Vec<(String, i64)> = entries
                    .iter()
                    .zip(&values)
                    .filter(|(_, noised)| **noised >= tau)
                    // Answers were checked to be UTF-8 (`Answer::read`).
                    .map(|((key, _), noised)| (String::from_utf8_lossy(key).into_owned(), *noised))
                    .collect();
                record.distinct_keys = Some(noised_distinct);
                record.distinct_keys_stddev = Some((check.variance as f64).sqrt());
                record.released_keys = Some(released.len() as u64);
                result.keys = Some(released);
            }
        }
        let bytes = serde_json::to_vec(&result)
            .map_err(|e| AggregateError::Unsupported(format!("the result: {e}")))?;
        let round = self.binding.context.round;
        let spent = plan.spent(&OpenDp, u32::try_from(round).unwrap_or(u32::MAX))?;
        let manifest = Manifest {
            format: manifest::FORMAT.to_string(),
            task_id: self.binding.context.task_id.clone(),
            round,
            key_id: self.binding.key_id.clone(),
            policy_sha256: self.binding.context.policy_sha256.clone(),
            model_sha256: self.binding.context.model_sha256.clone(),
            included: count,
            authenticated: self.device_auth.is_some().then_some(count),
            included_digest: digest(&outcome.included),
            inputs_digest: self.binding.inputs_digest.clone(),
            excluded: outcome.excluded_counts(),
            excluded_refs: outcome.listed_exclusions(),
            clip_norm: confed_protocol::policy::ANALYTICS_CLIP_NORM,
            noise: NoiseRecord {
                mechanism: "discrete_gaussian_on_counts".into(),
                grid_units_per_clip: 1,
                variance_grid: plan.variance,
                stddev_sum: noise.scale(),
                stddev_average: noise.scale() / count as f64,
                tree: None,
                blt: None,
            },
            privacy: PrivacyRecord {
                epsilon_budget: params.epsilon,
                delta: params.delta,
                rounds_planned: params.rounds,
                noise_multiplier: noise.scale() / plan.sensitivity(),
                rho_round: plan.rho_per_round,
                rho_spent: spent.rho,
                epsilon_spent: spent.epsilon,
            },
            adaptive_clipping: None,
            evaluation: None,
            health: None,
            analytics: Some(record),
            masking: None,
            average_sha256: hex(Sha256::digest(&bytes)),
        };
        Ok(AnalyticsRelease {
            result: bytes,
            manifest,
        })
    }
}

fn mismatch() -> AggregateError {
    AggregateError::Unsupported("the analytics table does not match the query".into())
}

fn dense(table: Table) -> Result<Vec<u64>, AggregateError> {
    table.into_dense().ok_or_else(mismatch)
}

/// Counts as signed values to noise (a round's counts are far below 2^63).
fn signed(counts: Vec<u64>) -> Vec<i64> {
    counts
        .into_iter()
        .map(|c| i64::try_from(c).unwrap_or(i64::MAX))
        .collect()
}

/// The value at `rank` read from the noised tree (post-processing, docs/privacy.md): from the
/// root down, at each level the child where the cumulative share of its siblings' counts (each
/// taken as at least 0) reaches the rank, the rank carried into it; in the leaf, linear
/// interpolation. A node whose children all count 0 or less spreads the rank uniformly.
pub fn quantile(levels: &[Vec<i64>], min: f64, max: f64, rank: f64) -> f64 {
    let branching = QUANTILE_BRANCHING as usize;
    let (mut low, mut width, mut target, mut node) = (min, max - min, rank, 0usize);
    for level in levels {
        let children: Vec<f64> = level[node * branching..(node + 1) * branching]
            .iter()
            .map(|v| (*v).max(0) as f64)
            .collect();
        let total: f64 = children.iter().sum();
        if total <= 0.0 {
            return low + target * width;
        }
        let wanted = target * total;
        let mut before = 0.0;
        let mut chosen = branching - 1;
        for (i, count) in children.iter().enumerate() {
            if *count > 0.0 && before + count >= wanted {
                chosen = i;
                break;
            }
            before += count;
        }
        let count = children[chosen].max(f64::MIN_POSITIVE);
        target = ((wanted - before) / count).clamp(0.0, 1.0);
        width /= branching as f64;
        low += chosen as f64 * width;
        node = node * branching + chosen;
    }
    low + target * width
}
