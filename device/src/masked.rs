//! A masked task's device side (docs/secure-aggregation.md): the device draws one seed per group
//! and seals each key service its groups' seeds as soon as it knows the model's size (before its
//! token is asked for: the token's nonce binds the sealed seeds), and at the send instant clips
//! its update on the grid itself (the enclave sees it only masked, so cannot clip it), adds every
//! group's stream and seals the masked vector.
//!
//! The masked vector is the model's tensors in ascending byte order of their names, each
//! row-major: the order the enclave's sum keeps (`ModelSchema`).

use confed_protocol::masking::{self, MaskContext, SealedSeeds, Seed};
use confed_protocol::policy::TaskPolicy;
use safetensors::{Dtype, SafeTensors};

use crate::client::DeviceError;

/// One assignment's mask seeds and their sealed copies: drawn with its token, used once when the
/// update is sealed. The seeds are wiped when dropped.
#[derive(Debug)]
pub struct MaskingSecrets {
    pub(crate) seeds: Vec<Seed>,
    pub(crate) sealed: Vec<SealedSeeds>,
    pub(crate) values: usize,
}

fn masking_error(error: masking::MaskingError) -> DeviceError {
    DeviceError::UntrustedPolicy(format!("masking: {error}"))
}

/// Draws the seeds of an update of `values` values for `assignment_ref` of `round` of the
/// (accepted) masked `policy` and seals them to its key services.
pub fn draw(
    policy: &TaskPolicy,
    round: u64,
    assignment_ref: &str,
    values: usize,
) -> Result<MaskingSecrets, DeviceError> {
    let masking = policy.masking.as_ref().ok_or_else(|| {
        DeviceError::UntrustedPolicy("the task's policy does not mask its updates".into())
    })?;
    let layout = masking.layout();
    let policy_sha256 = policy.sha256_hex();
    let context = MaskContext::new(
        &policy.task_id,
        round,
        assignment_ref,
        &policy_sha256,
        values,
    )
    .map_err(masking_error)?;
    let seeds: Vec<Seed> = layout.groups().iter().map(|_| Seed::random()).collect();
    let sealed = masking::seal_seeds(&layout, &seeds, &masking.public_keys(), &context)
        .map_err(masking_error)?;
    Ok(MaskingSecrets {
        seeds,
        sealed,
        values,
    })
}

/// The number of values of a model's masked vector: all its tensors' elements.
pub fn values_of(model: &[u8]) -> Result<usize, DeviceError> {
    let parsed = SafeTensors::deserialize(model)
        .map_err(|e| DeviceError::Training(format!("the model is not safetensors: {e}")))?;
    Ok(parsed
        .tensors()
        .iter()
        .map(|(_, view)| view.shape().iter().product::<usize>())
        .sum())
}

/// The update's values in the masked vector's order: tensors by ascending name, row-major.
fn flatten(update: &[u8]) -> Result<Vec<f32>, DeviceError> {
    let parsed = SafeTensors::deserialize(update)
        .map_err(|e| DeviceError::Training(format!("the update is not safetensors: {e}")))?;
    let mut tensors = parsed.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let mut values = Vec::new();
    for (name, view) in tensors {
        if view.dtype() != Dtype::F32 {
            return Err(DeviceError::Training(format!(
                "update tensor {name} is not F32"
            )));
        }
        values.extend(
            view.data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
        );
    }
    Ok(values)
}

/// The masked update to seal in place of `update` (the well-formed update due at the send
/// instant): clipped on the grid to the policy's clip norm, every group's stream added.
pub fn masked_update(
    policy: &TaskPolicy,
    round: u64,
    assignment_ref: &str,
    secrets: &MaskingSecrets,
    update: &[u8],
) -> Result<Vec<u8>, DeviceError> {
    let masking = policy.masking.as_ref().ok_or_else(|| {
        DeviceError::UntrustedPolicy("the task's policy does not mask its updates".into())
    })?;
    let values = zeroize::Zeroizing::new(flatten(update)?);
    if values.len() != secrets.values {
        return Err(DeviceError::Training(format!(
            "the update has {} values, its seeds were drawn for {}",
            values.len(),
            secrets.values
        )));
    }
    let grid = zeroize::Zeroizing::new(confed_protocol::grid::clip_to_grid(
        &values,
        policy.clip_norm,
    ));
    let policy_sha256 = policy.sha256_hex();
    let context = MaskContext::new(
        &policy.task_id,
        round,
        assignment_ref,
        &policy_sha256,
        secrets.values,
    )
    .map_err(masking_error)?;
    let masked =
        masking::mask(&masking.layout(), &grid, &secrets.seeds, &context).map_err(masking_error)?;
    Ok(masking::encode_masked(&masked, masking.layout().ring()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use confed_protocol::hpke::{PrivateKey, generate_keypair};
    use confed_protocol::masking::{MaskSums, NoiseRoom, open_seeds, read_masked, unmask};
    use confed_protocol::masking_keys::{MaskingPolicy, MaskingService, sign_masking_key};

    const REF: &str = "a3f1c9a0e6b7d4e21a3f1c9a0e6b7d4e21a3f1c9a0e6b7d4e21a3f1c9a0e6b7d";

    fn masked_policy(n: usize, t: u8) -> (TaskPolicy, Vec<PrivateKey>) {
        let signer = confed_protocol::keyset::generate_signing_key();
        let mut privates = Vec::new();
        let services = (1..=n)
            .map(|i| {
                let (private, public) = generate_keypair();
                privates.push(private);
                let id = format!("ks{i}");
                MaskingService {
                    key: sign_masking_key(&signer, &id, &public),
                    verifying_key: confed_protocol::keyset::encode_verifying_key(
                        signer.verifying_key(),
                    ),
                    keyservice_id: id,
                }
            })
            .collect();
        let mut policy = TaskPolicy::sample("masked-task", 2);
        policy.clip_norm = 2.0;
        policy.masking = Some(MaskingPolicy::new(t, services).unwrap());
        (policy, privates)
    }

    fn update(tensors: &[(&str, Vec<f32>)]) -> Vec<u8> {
        let bytes: Vec<(String, Vec<u8>)> = tensors
            .iter()
            .map(|(n, v)| {
                (
                    n.to_string(),
                    v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                )
            })
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bytes
            .iter()
            .zip(tensors)
            .map(|((name, data), (_, v))| {
                let view =
                    safetensors::tensor::TensorView::new(Dtype::F32, vec![v.len()], data).unwrap();
                (name.clone(), view)
            })
            .collect();
        safetensors::serialize(views, None).unwrap()
    }

    #[test]
    fn a_masked_update_is_the_clipped_grid_in_name_order_once_the_key_services_masks_are_removed() {
        let (policy, privates) = masked_policy(3, 2);
        let layout = policy.masking.as_ref().unwrap().layout();
        // Named out of order, and above the clip norm of 2 (norm 5): clipped on the device.
        let bytes = update(&[("z.bias", vec![3.0]), ("a.weight", vec![4.0, 0.0])]);
        let secrets = draw(&policy, 1, REF, 3).unwrap();
        assert_eq!(secrets.sealed.len(), 3);
        let plaintext = masked_update(&policy, 1, REF, &secrets, &bytes).unwrap();
        let masked: Vec<u64> = read_masked(&plaintext, 3, layout.ring())
            .unwrap()
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        let policy_sha256 = policy.sha256_hex();
        let ctx = MaskContext::new("masked-task", 1, REF, &policy_sha256, 3).unwrap();
        let answers: Vec<MaskSums> = (1..=3u8)
            .map(|service| {
                let opened = open_seeds(
                    &layout,
                    &privates[usize::from(service) - 1],
                    &secrets.sealed[usize::from(service) - 1],
                    &ctx,
                )
                .unwrap();
                let mut sums = MaskSums::new(&layout, service, 3).unwrap();
                sums.add(&opened, &ctx, layout.ring()).unwrap();
                sums
            })
            .collect();
        let grid = unmask(&layout, &masked, &answers, 1, 65_536, NoiseRoom::default()).unwrap();
        // a.weight's values first, then z.bias; clipped to the clip norm: on the grid the
        // vector's length is just under 2^16 units (the exact check rounds down).
        let expected = confed_protocol::grid::clip_to_grid(&[4.0, 0.0, 3.0], 2.0);
        assert_eq!(grid.as_slice(), expected.as_slice());
        let norm = ((grid[0] * grid[0] + grid[2] * grid[2]) as f64).sqrt();
        assert!((65_530.0..=65_536.0).contains(&norm), "{norm}");
        assert_eq!(grid[1], 0);
        assert!(grid[0] > grid[2], "4 before 3: {grid:?}");
    }

    #[test]
    fn an_update_of_another_size_than_its_seeds_is_refused() {
        let (policy, _) = masked_policy(3, 2);
        let secrets = draw(&policy, 1, REF, 4).unwrap();
        let bytes = update(&[("w", vec![1.0, 2.0])]);
        let error = masked_update(&policy, 1, REF, &secrets, &bytes).unwrap_err();
        assert!(error.to_string().contains("drawn for 4"), "{error}");
        let plain = TaskPolicy::sample("plain", 1);
        assert!(draw(&plain, 1, REF, 4).is_err());
    }
}
