//! Simulated devices' local records for analytics tasks (`confed devices simulate`, `confed demo
//! --analytics`): each device holds a few words drawn from a Zipf vocabulary, and each planted new
//! word with its own probability, so a discovery query has a known truth to be measured against.
//! Closed-domain queries read the words' ranks as key indices; quantile queries a value that grows
//! with the rank. Deterministic per (seed, device).

use std::sync::Arc;

use confed_device::Records;
use confed_protocol::analytics::AnalyticsQuery;

use super::train::Rng;

#[derive(Debug, Clone)]
pub struct AnalyticsPopulation {
    /// Ranks 1..=vocabulary, named `w<rank>`, drawn with probability proportional to
    /// `rank^-exponent`.
    pub vocabulary: u64,
    pub exponent: f64,
    /// Words a device draws from the vocabulary (repeats collapse into one key).
    pub words_per_device: usize,
    /// New words and the share of devices holding each.
    pub planted: Vec<(String, f64)>,
    /// Cumulative weights of the ranks (built once).
    cumulative: Arc<Vec<f64>>,
}

impl Default for AnalyticsPopulation {
    fn default() -> Self {
        Self::new(10_000, 1.1, 4, Vec::new())
    }
}

impl AnalyticsPopulation {
    pub fn new(
        vocabulary: u64,
        exponent: f64,
        words_per_device: usize,
        planted: Vec<(String, f64)>,
    ) -> Self {
        let vocabulary = vocabulary.max(1);
        let mut total = 0.0;
        let cumulative = (1..=vocabulary)
            .map(|rank| {
                total += (rank as f64).powf(-exponent);
                total
            })
            .collect();
        Self {
            vocabulary,
            exponent,
            words_per_device,
            planted,
            cumulative: Arc::new(cumulative),
        }
    }

    /// One rank drawn from the Zipf distribution.
    fn rank(&self, rng: &mut Rng) -> u64 {
        let total = self.cumulative.last().copied().unwrap_or(1.0);
        let target = f64::from(rng.uniform()) * total;
        self.cumulative.partition_point(|c| *c < target) as u64 + 1
    }

    /// The words device `device` holds (ranks as `w<rank>`, then the planted words it holds).
    pub fn words(&self, device: u64, seed: u64) -> Vec<String> {
        let mut rng = Rng::new(seed ^ device.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0xa11a);
        let mut words: Vec<String> = (0..self.words_per_device)
            .map(|_| format!("w{}", self.rank(&mut rng)))
            .collect();
        for (word, share) in &self.planted {
            if f64::from(rng.uniform()) < *share {
                words.push(word.clone());
            }
        }
        words
    }

    /// The device's records, of the kind `query` reads.
    pub fn records(&self, query: &AnalyticsQuery, device: u64, seed: u64) -> Records {
        let words = self.words(device, seed);
        let rank = |word: &String| word.trim_start_matches('w').parse::<u64>().ok();
        match query {
            AnalyticsQuery::OpenHistogram { .. } => Records::Strings(words),
            AnalyticsQuery::Histogram { max_value, .. } => Records::Keyed(
                words
                    .iter()
                    .filter_map(rank)
                    .map(|r| (r - 1, 1 + r % (*max_value).max(1)))
                    .collect(),
            ),
            AnalyticsQuery::Quantiles { min, max, .. } => Records::Values(
                words
                    .iter()
                    .filter_map(rank)
                    .map(|r| {
                        min + (max - min) * (r as f64).ln() / (self.vocabulary as f64).ln().max(1.0)
                    })
                    .collect(),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_planted_word_is_held_by_about_its_share_of_devices() {
        let population = AnalyticsPopulation::new(20_000, 1.0, 4, vec![("new".into(), 0.08)]);
        let holders = (0..5000u64)
            .filter(|d| population.words(*d, 6).iter().any(|w| w == "new"))
            .count();
        // 400 expected; 5 standard deviations of a binomial: 96.
        assert!((holders as i64 - 400).abs() < 96, "{holders}");
    }
}
