//! What a simulated device trains: softmax regression (`dense.weight` [classes, features],
//! `dense.bias` [classes]) by mini-batch SGD on its private shard, in plain Rust. The shard comes
//! from a deterministic synthetic data set: one Gaussian blob per class, and each device holds
//! mostly two classes (non-IID, as real devices do).
//!
//! To use a real data set instead, produce a `Dataset` from your rows (features as f32, a class
//! index per row) and split it over devices with `Dataset::shard`-like logic; the training and the
//! protocol do not care where rows come from.

use safetensors::SafeTensors;

use confed_device::DeviceError;

/// A small deterministic generator (SplitMix64), so simulations reproduce.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Standard normal (Box-Muller). For synthetic data only: never for privacy noise.
    pub fn normal(&mut self) -> f32 {
        let u1 = self.uniform().max(1e-7);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Rows of features with a class label each.
#[derive(Debug, Clone)]
pub struct Dataset {
    pub features: usize,
    pub classes: usize,
    pub x: Vec<f32>,
    pub y: Vec<usize>,
}

impl Dataset {
    pub fn len(&self) -> usize {
        self.y.len()
    }

    pub fn is_empty(&self) -> bool {
        self.y.is_empty()
    }

    fn row(&self, i: usize) -> &[f32] {
        &self.x[i * self.features..(i + 1) * self.features]
    }
}

/// The synthetic task: `classes` Gaussian blobs in `features` dimensions, centres fixed by `seed`.
#[derive(Debug, Clone)]
pub struct Synthetic {
    pub features: usize,
    pub classes: usize,
    centres: Vec<f32>,
    seed: u64,
}

impl Synthetic {
    /// The simulator's task: 10 overlapping classes in 32 dimensions. Hard enough that a model
    /// improves over several rounds (chance is 10 %), easy enough to learn with DP noise.
    pub fn standard(seed: u64) -> Self {
        Self::new(32, 10, seed, 0.35)
    }

    /// `classes` blobs whose centres are drawn with standard deviation `separation` per feature
    /// (samples have unit variance around their centre).
    pub fn new(features: usize, classes: usize, seed: u64, separation: f32) -> Self {
        let mut rng = Rng::new(seed);
        let centres = (0..features * classes)
            .map(|_| separation * rng.normal())
            .collect();
        Self {
            features,
            classes,
            centres,
            seed,
        }
    }

    fn sample(&self, rng: &mut Rng, class: usize, out: &mut Dataset) {
        let centre = &self.centres[class * self.features..(class + 1) * self.features];
        out.x.extend(centre.iter().map(|c| c + rng.normal()));
        out.y.push(class);
    }

    /// Device `index`'s private shard: 80 % from two classes of its own, 20 % from any class.
    pub fn shard(&self, index: u64, rows: usize) -> Dataset {
        self.shard_from(
            index,
            rows,
            self.seed ^ index.wrapping_mul(0xa076_1d64_78bd_642f),
        )
    }

    /// Device `index`'s held-out examples (what it evaluates models on): drawn as its shard is,
    /// from other randomness.
    pub fn held_out(&self, index: u64, rows: usize) -> Dataset {
        let seed = self.seed ^ index.wrapping_mul(0xe703_7ed1_a0b4_28db) ^ 0x4e1d;
        self.shard_from(index, rows, seed)
    }

    fn shard_from(&self, index: u64, rows: usize, seed: u64) -> Dataset {
        let mut rng = Rng::new(seed);
        let own = [
            index as usize % self.classes,
            (index as usize + 1) % self.classes,
        ];
        let mut data = Dataset {
            features: self.features,
            classes: self.classes,
            x: Vec::new(),
            y: Vec::new(),
        };
        for _ in 0..rows {
            let class = if rng.uniform() < 0.8 {
                own[rng.below(2)]
            } else {
                rng.below(self.classes)
            };
            self.sample(&mut rng, class, &mut data);
        }
        data
    }

    /// A balanced test set, disjoint in randomness from every shard.
    pub fn test_set(&self, rows: usize) -> Dataset {
        let mut rng = Rng::new(self.seed.rotate_left(17) ^ 0x5eed);
        let mut data = Dataset {
            features: self.features,
            classes: self.classes,
            x: Vec::new(),
            y: Vec::new(),
        };
        for i in 0..rows {
            self.sample(&mut rng, i % self.classes, &mut data);
        }
        data
    }
}

/// Softmax regression parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct Softmax {
    pub classes: usize,
    pub features: usize,
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

pub const WEIGHT: &str = "dense.weight";
pub const BIAS: &str = "dense.bias";

fn f32s(view: &safetensors::tensor::TensorView<'_>) -> Vec<f32> {
    view.data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

impl Softmax {
    pub fn zeros(classes: usize, features: usize) -> Self {
        Self {
            classes,
            features,
            weight: vec![0.0; classes * features],
            bias: vec![0.0; classes],
        }
    }

    /// Reads a model file of the expected shape. Subnormal weights read as zero: a model of
    /// subnormal weights would otherwise make every step slow until the data steers it out of
    /// them (timing defence in depth; the send instant is the fix, docs/privacy.md, "Time").
    pub fn from_safetensors(bytes: &[u8]) -> Result<Self, DeviceError> {
        let bad = |why: String| {
            DeviceError::Training(format!(
                "the model must be softmax regression ({WEIGHT} [classes, features] and {BIAS} [classes], F32): {why}"
            ))
        };
        let tensors = SafeTensors::deserialize(bytes).map_err(|e| bad(e.to_string()))?;
        let weight = tensors.tensor(WEIGHT).map_err(|e| bad(e.to_string()))?;
        let bias = tensors.tensor(BIAS).map_err(|e| bad(e.to_string()))?;
        let (&[classes, features], &[bias_len]) = (weight.shape(), bias.shape()) else {
            return Err(bad("wrong ranks".into()));
        };
        if bias_len != classes
            || weight.dtype() != safetensors::Dtype::F32
            || bias.dtype() != safetensors::Dtype::F32
        {
            return Err(bad("shapes or dtypes disagree".into()));
        }
        let mut model = Self {
            classes,
            features,
            weight: f32s(&weight),
            bias: f32s(&bias),
        };
        model.flush_subnormals();
        Ok(model)
    }

    /// Sets subnormal parameters to zero (the CPU computes on them tens of times slower).
    fn flush_subnormals(&mut self) {
        flush_subnormals(&mut self.weight);
        flush_subnormals(&mut self.bias);
    }

    pub fn to_safetensors(&self) -> Vec<u8> {
        let tensors = [
            (WEIGHT, vec![self.classes, self.features], &self.weight[..]),
            (BIAS, vec![self.classes], &self.bias[..]),
        ];
        confed_worker_api::model::encode_f32_tensors(&tensors).expect("softmax tensors serialize")
    }

    fn probabilities(&self, row: &[f32], out: &mut [f32]) {
        for (c, slot) in out.iter_mut().enumerate() {
            let w = &self.weight[c * self.features..(c + 1) * self.features];
            *slot = self.bias[c] + w.iter().zip(row).map(|(a, b)| a * b).sum::<f32>();
        }
        let max = out.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut total = 0.0;
        for v in out.iter_mut() {
            *v = (*v - max).exp();
            total += *v;
        }
        for v in out.iter_mut() {
            *v /= total;
        }
        flush_subnormals(out);
    }

    /// Mini-batch SGD over `data` for `epochs`.
    pub fn train(&mut self, data: &Dataset, epochs: usize, batch: usize, learning_rate: f32) {
        self.train_until(data, epochs, batch, learning_rate, || false);
    }

    /// `train`, stopping before the next batch once `stop()` says so (the device's send instant
    /// has passed: nothing computed after it is sent). Subnormals are flushed after every step.
    pub fn train_until(
        &mut self,
        data: &Dataset,
        epochs: usize,
        batch: usize,
        learning_rate: f32,
        stop: impl Fn() -> bool,
    ) {
        let mut p = vec![0.0; self.classes];
        let batch = batch.max(1);
        for _ in 0..epochs {
            for start in (0..data.len()).step_by(batch) {
                if stop() {
                    return;
                }
                let end = (start + batch).min(data.len());
                let mut grad_w = vec![0.0; self.weight.len()];
                let mut grad_b = vec![0.0; self.classes];
                for i in start..end {
                    let row = data.row(i);
                    self.probabilities(row, &mut p);
                    for c in 0..self.classes {
                        let err = p[c] - if data.y[i] == c { 1.0 } else { 0.0 };
                        grad_b[c] += err;
                        for (g, x) in grad_w[c * self.features..(c + 1) * self.features]
                            .iter_mut()
                            .zip(row)
                        {
                            *g += err * x;
                        }
                    }
                }
                let scale = learning_rate / (end - start) as f32;
                self.weight
                    .iter_mut()
                    .zip(&grad_w)
                    .for_each(|(w, g)| *w -= scale * g);
                self.bias
                    .iter_mut()
                    .zip(&grad_b)
                    .for_each(|(b, g)| *b -= scale * g);
                self.flush_subnormals();
            }
        }
    }

    /// Fraction of `data` classified correctly.
    pub fn accuracy(&self, data: &Dataset) -> f64 {
        f64::from(self.evaluate(data, f64::INFINITY)[1]) / data.len().max(1) as f64
    }

    /// `[loss_sum, correct, examples]` over `data`: the summed cross-entropy, each example's at
    /// most `max_loss` (the task policy's bound; the probability is floored at 1e-12, so at most
    /// about 27.6 anyway), the rows classified correctly and the rows.
    pub fn evaluate(&self, data: &Dataset, max_loss: f64) -> [f32; 3] {
        let mut p = vec![0.0; self.classes];
        let (mut loss, mut correct) = (0.0f64, 0usize);
        for i in 0..data.len() {
            self.probabilities(data.row(i), &mut p);
            let best = (0..self.classes)
                .max_by(|&a, &b| p[a].total_cmp(&p[b]))
                .unwrap_or(0);
            correct += usize::from(best == data.y[i]);
            loss += (-f64::from(p[data.y[i]].max(1e-12)).ln()).min(max_loss);
        }
        [loss as f32, correct as f32, data.len() as f32]
    }

    /// `self - base`, the update a device uploads.
    pub fn delta_from(&self, base: &Softmax) -> Softmax {
        Softmax {
            classes: self.classes,
            features: self.features,
            weight: self
                .weight
                .iter()
                .zip(&base.weight)
                .map(|(a, b)| a - b)
                .collect(),
            bias: self
                .bias
                .iter()
                .zip(&base.bias)
                .map(|(a, b)| a - b)
                .collect(),
        }
    }
}

/// Sets every subnormal value of `values` to zero (keeping its sign).
fn flush_subnormals(values: &mut [f32]) {
    for v in values.iter_mut() {
        if v.is_subnormal() {
            *v = 0.0f32.copysign(*v);
        }
    }
}

/// Training hyper-parameters from the task's plan (defaults where absent).
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    pub epochs: usize,
    pub batch_size: usize,
    pub learning_rate: f32,
}

impl Plan {
    pub fn from_json(plan: &serde_json::Value) -> Self {
        let int = |name: &str, default: usize| {
            plan.get(name)
                .and_then(|v| v.as_u64())
                .map_or(default, |v| v as usize)
        };
        Self {
            epochs: int("epochs", 1).clamp(1, 100),
            batch_size: int("batch_size", 32).clamp(1, 10_000),
            learning_rate: plan
                .get("learning_rate")
                .and_then(|v| v.as_f64())
                .map_or(0.1, |v| v as f32),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_training_learns_the_devices_classes() {
        let task = Synthetic::new(8, 4, 7, 1.5);
        let shard = task.shard(0, 400);
        let mut model = Softmax::zeros(4, 8);
        model.train(&shard, 5, 32, 0.1);
        assert!(model.accuracy(&shard) > 0.8, "{}", model.accuracy(&shard));
    }

    #[test]
    fn shards_are_non_iid_and_deterministic() {
        let task = Synthetic::new(4, 10, 1, 1.5);
        let a = task.shard(3, 200);
        assert_eq!(a.y, task.shard(3, 200).y);
        let own = a.y.iter().filter(|&&c| c == 3 || c == 4).count();
        assert!(own > 140, "{own} of 200 rows from the device's two classes");
    }

    #[test]
    fn subnormal_weights_read_as_zero_and_training_stops_when_told() {
        let mut model = Softmax::zeros(2, 2);
        model.weight = vec![1e-40, -1e-40, 0.5, f32::MIN_POSITIVE];
        let read = Softmax::from_safetensors(&model.to_safetensors()).unwrap();
        assert_eq!(read.weight, [0.0, -0.0, 0.5, f32::MIN_POSITIVE]);
        assert!(read.weight[1].is_sign_negative());
        let task = Synthetic::new(2, 2, 3, 1.5);
        let shard = task.shard(0, 64);
        let mut stopped = read.clone();
        stopped.train_until(&shard, 5, 8, 0.1, || true);
        assert_eq!(stopped, read, "no step after the stop");
    }

    #[test]
    fn safetensors_round_trip_and_delta() {
        let mut model = Softmax::zeros(3, 2);
        model.weight[1] = 0.5;
        let back = Softmax::from_safetensors(&model.to_safetensors()).unwrap();
        assert_eq!(back, model);
        let delta = model.delta_from(&Softmax::zeros(3, 2));
        assert_eq!(delta.weight[1], 0.5);
        assert!(Softmax::from_safetensors(b"junk").is_err());
    }
}
