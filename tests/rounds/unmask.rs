//! The key services' unmask endpoints (docs/secure-aggregation.md): after a real attested
//! release of a masked round, each agrees to one included set and signs a receipt; against
//! `agreement(t, n)` receipts each returns its groups' mask sums, and the sums remove the masks
//! exactly. Another set for the round, too few receipts, seeds no token binds, or a request
//! before the release are refused, and the one set per round survives a restart. With distributed
//! noise each service adds its group's draw, the same on every request.

use confed_attestation::unmask::UnmaskReceipt;
use confed_attestation::unmask_api::{AgreeRequest, MaskedInput, SumsRequest, UnmaskRound};
use confed_protocol::device_auth::DeviceAuth;
use confed_protocol::hpke::{self, PrivateKey};
use confed_protocol::masking::{
    Layout, MaskContext, MaskSums, NoiseRoom, Seed, envelope_seeds, mask, seal_seeds, split_seeds,
    unmask,
};
use confed_protocol::masking_keys::{MaskingPolicy, MaskingService, sign_masking_key};
use confed_protocol::masking_noise::NoiseKeys;
use confed_protocol::policy::TaskPolicy;
use confed_protocol::privacy_pass::context::{
    encoded_round_challenge, masked_token_nonce, seeds_digest,
};
use confed_protocol::privacy_pass::issuance::{TokenClient, TokenSigner};

use crate::common::keyservices::{
    Behaviour, TIMEOUT, World, collect_with, commitment, public_key, serve,
};
use confed::keyservice::routes;
use confed_enclave::key_collection::{KeyRequest, KeyServiceEndpoint};

pub(super) const VALUES: usize = 16;
pub(super) const DEVICES: usize = 5;
pub(super) const TASK: &str = "task-1";

/// One device's masked input as the enclave holds it.
#[derive(Clone)]
pub(super) struct Input {
    pub(super) assignment_ref: String,
    pub(super) enc: Vec<u8>,
    pub(super) token: Vec<u8>,
    pub(super) seeds: Vec<u8>,
    masked: Vec<u64>,
    grid: Vec<i64>,
    /// The device's seeds, one per group (for the test's own noise keys).
    device_seeds: Vec<Seed>,
}

pub(super) struct Masked {
    world: World,
    masking_keys: Vec<PrivateKey>,
    pub(super) policy: TaskPolicy,
    endpoints: Vec<KeyServiceEndpoint>,
    commitment_sha256: String,
    pub(super) inputs: Vec<Input>,
}

fn token(signer: &TokenSigner, assignment_ref: &str, nonce: [u8; 32]) -> Vec<u8> {
    let client = TokenClient::from_spki(signer.spki()).unwrap();
    let challenge = encoded_round_challenge("issuer.test", TASK, 1, assignment_ref).unwrap();
    let (request, pending) = client.begin_with_nonce(&challenge, nonce).unwrap();
    client
        .finish(pending, &signer.sign(&request).unwrap())
        .unwrap()
        .encode()
}

pub(super) fn masked_input(
    layout: &Layout,
    policy: &TaskPolicy,
    signer: &TokenSigner,
    d: usize,
) -> Input {
    let masking = policy.masking.as_ref().unwrap();
    let assignment_ref = confed_protocol::envelope::assignment_ref(&format!("device-{d}"));
    let grid: Vec<i64> = (0..VALUES).map(|i| (d * 100 + i) as i64 - 700).collect();
    let policy_sha256 = &policy.sha256_hex();
    let ctx = MaskContext::new(TASK, 1, &assignment_ref, policy_sha256, VALUES).unwrap();
    let seeds: Vec<Seed> = layout.groups().iter().map(|_| Seed::random()).collect();
    let sealed = seal_seeds(layout, &seeds, &masking.public_keys(), &ctx).unwrap();
    let enc = vec![d as u8; 32];
    let digests: Vec<[u8; 32]> = sealed.iter().map(|s| seeds_digest(&s.to_bytes())).collect();
    Input {
        token: token(signer, &assignment_ref, masked_token_nonce(&enc, &digests)),
        masked: mask(layout, &grid, &seeds, &ctx).unwrap(),
        seeds: envelope_seeds(&sealed),
        device_seeds: seeds,
        enc,
        grid,
        assignment_ref,
    }
}

/// Three key services (2 of 3) with masking keys, a masked task's round released for real.
async fn released() -> Masked {
    released_with(None).await
}

/// The same, with distributed noise of `noise` per group if it is `Some`.
pub(super) async fn released_with(noise: Option<u64>) -> Masked {
    let world = World::new(2, 3);
    let signer = crate::common::issuer::signer();
    let masking_keys: Vec<PrivateKey> = (0..3).map(|_| hpke::generate_keypair().0).collect();
    let services = (1..=3)
        .map(|i| {
            let id = format!("ks{i}");
            let signing = world.signing_key(i);
            MaskingService {
                key: sign_masking_key(&signing, &id, &masking_keys[i - 1].public_key().unwrap()),
                verifying_key: confed_protocol::keyset::encode_verifying_key(
                    signing.verifying_key(),
                ),
                keyservice_id: id,
            }
        })
        .collect();
    let mut policy = TaskPolicy::sample(TASK, 3);
    policy.device_auth =
        Some(DeviceAuth::new("issuer.test", vec![signer.spki().to_vec()]).unwrap());
    let masking = MaskingPolicy::new(2, services).unwrap();
    policy.masking = Some(match noise {
        Some(variance) => masking.with_noise(variance).unwrap(),
        None => masking,
    });
    let endpoints = start(&world, &masking_keys).await;
    let commitment = commitment(&world.key.key_id, &policy, 1, "1");
    let request = KeyRequest {
        key_id: world.key.key_id.clone(),
        public_key: public_key(&world.key),
        threshold: world.key.threshold,
        task_id: TASK.into(),
        round: 1,
        commitment: commitment.clone(),
        policy: policy.encode(),
    };
    collect_with(&endpoints, &world, &request, TIMEOUT)
        .await
        .unwrap();
    let layout = policy.masking.as_ref().unwrap().layout();
    let mut inputs: Vec<Input> = (0..DEVICES)
        .map(|d| masked_input(&layout, &policy, &signer, d))
        .collect();
    inputs.sort_by(|a, b| a.assignment_ref.cmp(&b.assignment_ref));
    Masked {
        world,
        masking_keys,
        policy,
        endpoints,
        commitment_sha256: commitment.digest(),
        inputs,
    }
}

pub(super) fn refs(inputs: &[Input]) -> Vec<String> {
    inputs.iter().map(|i| i.assignment_ref.clone()).collect()
}

async fn start(world: &World, masking_keys: &[PrivateKey]) -> Vec<KeyServiceEndpoint> {
    let mut endpoints = Vec::new();
    for (i, key) in masking_keys.iter().enumerate() {
        let service = world
            .service(i + 1, Behaviour::Honest, &world.share_files[i..=i])
            .with_masking_key(PrivateKey::from_bytes(key.as_bytes()).unwrap());
        endpoints.push(KeyServiceEndpoint {
            id: service.id.clone(),
            url: serve(routes::router(service)).await,
        });
    }
    endpoints
}

impl Masked {
    pub(super) fn round(&self) -> UnmaskRound {
        UnmaskRound {
            task_id: TASK.into(),
            round: 1,
            commitment_sha256: self.commitment_sha256.clone(),
            policy: self.policy.encode(),
        }
    }

    pub(super) async fn post(
        &self,
        service: usize,
        route: &str,
        body: &impl serde::Serialize,
    ) -> reqwest::Response {
        confed_protocol::http::client(TIMEOUT)
            .post(format!(
                "{}/v1/keys/{}/unmask/{route}",
                self.endpoints[service].url, self.world.key.key_id
            ))
            .json(body)
            .send()
            .await
            .unwrap()
    }

    pub(super) async fn agree(&self, service: usize, inputs: &[Input]) -> reqwest::Response {
        let request = AgreeRequest {
            round: self.round(),
            included: refs(inputs),
        };
        self.post(service, "agree", &request).await
    }

    pub(super) fn sums_request(
        &self,
        service: usize,
        receipts: &[UnmaskReceipt],
        inputs: &[Input],
    ) -> SumsRequest {
        SumsRequest {
            round: self.round(),
            values: VALUES as u64,
            receipts: receipts.to_vec(),
            inputs: self.masked_inputs(service, inputs),
        }
    }

    /// `inputs` as the enclave names them to key service `service` (0-based): its item of each
    /// input's seeds and every item's digest.
    pub(super) fn masked_inputs<'a>(
        &self,
        service: usize,
        inputs: impl IntoIterator<Item = &'a Input>,
    ) -> Vec<MaskedInput> {
        let layout = self.policy.masking.as_ref().unwrap().layout();
        inputs
            .into_iter()
            .map(|i| {
                let items = split_seeds(&layout, &i.seeds).unwrap();
                MaskedInput::of_envelope(
                    &i.assignment_ref,
                    &i.enc,
                    &i.token,
                    &items,
                    service as u8 + 1,
                )
            })
            .collect()
    }
}

/// The variance `policy`'s budget calibrates per group (the closed form, without margin).
pub(super) fn calibrated_variance(policy: &TaskPolicy) -> u64 {
    let z = confed_dp::calibrate_task(
        &confed_dp::ClosedForm,
        policy.dp_mechanism().unwrap(),
        policy.epsilon,
        policy.delta,
        policy.rounds,
    )
    .unwrap()
    .noise_multiplier;
    (z * 65536.0).powi(2).ceil() as u64
}

impl Masked {
    /// Every service's receipt for the whole set.
    pub(super) async fn agreed(&self) -> Vec<UnmaskReceipt> {
        let mut receipts = Vec::new();
        for service in 0..3 {
            let answer = self.agree(service, &self.inputs).await;
            assert_eq!(answer.status(), 200);
            receipts.push(answer.json().await.unwrap());
        }
        receipts
    }

    /// Service `service`'s (0-based) mask sums over the whole set: its raw answer and parsed.
    pub(super) async fn sums(
        &self,
        service: u8,
        receipts: &[UnmaskReceipt],
    ) -> (Vec<u8>, MaskSums) {
        let layout = self.policy.masking.as_ref().unwrap().layout();
        let answer = self
            .post(
                usize::from(service),
                "sums",
                &self.sums_request(usize::from(service), receipts, &self.inputs),
            )
            .await;
        assert_eq!(answer.status(), 200);
        let bytes = answer.bytes().await.unwrap().to_vec();
        let groups = layout.groups_of(service + 1);
        assert_eq!(bytes.len(), groups.len() * VALUES * 8);
        let sums = groups
            .iter()
            .zip(bytes.chunks_exact(VALUES * 8))
            .map(|(&g, chunk)| {
                (
                    g,
                    chunk
                        .chunks_exact(8)
                        .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
                        .collect(),
                )
            })
            .collect();
        let parsed = MaskSums {
            service: service + 1,
            sums,
        };
        (bytes, parsed)
    }

    /// The inputs' masked sum and their exact sum.
    pub(super) fn sums_in_the_clear(&self) -> (Vec<u64>, Vec<i64>) {
        let mut masked_sum = vec![0u64; VALUES];
        let mut exact = vec![0i64; VALUES];
        for input in &self.inputs {
            for i in 0..VALUES {
                masked_sum[i] = masked_sum[i].wrapping_add(input.masked[i]);
                exact[i] += input.grid[i];
            }
        }
        (masked_sum, exact)
    }

    /// What every service's sums over the whole set, against `receipts`, unmask the inputs'
    /// masked sum to (with room for distributed noise of `variance`), and their exact sum.
    pub(super) async fn unmasked_by_all(
        &self,
        receipts: &[UnmaskReceipt],
        variance: u64,
    ) -> (Vec<i64>, Vec<i64>) {
        let mut answers = Vec::new();
        for service in 0..3u8 {
            answers.push(self.sums(service, receipts).await.1);
        }
        self.unmasked_from(&answers, variance)
    }

    /// What the services' parsed sums `answers` unmask the inputs' masked sum to (with room for
    /// distributed noise of `variance`), and the inputs' exact sum.
    pub(super) fn unmasked_from(
        &self,
        answers: &[MaskSums],
        variance: u64,
    ) -> (Vec<i64>, Vec<i64>) {
        let layout = self.policy.masking.as_ref().unwrap().layout();
        let (masked_sum, exact) = self.sums_in_the_clear();
        let room = NoiseRoom::of(VALUES, variance, 3);
        let unmasked = unmask(&layout, &masked_sum, answers, DEVICES as u64, 1 << 16, room)
            .unwrap()
            .to_vec();
        (unmasked, exact)
    }
}

/// `exact` plus every group's draw over `m`'s inputs, from the test's own keys: group g's
/// seeds of every input, refs ascending.
pub(super) fn noised(m: &Masked, variance: u64, exact: &[i64]) -> Vec<i64> {
    let layout = m.policy.masking.as_ref().unwrap().layout();
    let policy_sha256 = m.policy.sha256_hex();
    let mut expected = exact.to_vec();
    for group in 0..layout.groups().len() {
        let mut keys = NoiseKeys::new(&[group], m.inputs.len());
        for input in &m.inputs {
            let ctx =
                MaskContext::new(TASK, 1, &input.assignment_ref, &policy_sha256, VALUES).unwrap();
            keys.absorb(&[(group, input.device_seeds[group].clone())], &ctx)
                .unwrap();
        }
        let (_, key) = &keys.finish()[0];
        for (sum, z) in expected
            .iter_mut()
            .zip(confed_dp::distributed::noise(VALUES, variance, key))
        {
            *sum += z;
        }
    }
    expected
}

/// Distributed noise: each service subtracts its group's draw from its mask sums, keyed by the
/// group's seeds over the agreed set, and answers the same bytes when asked again (fresh noise
/// per request would average away); the unmasked sum is the exact sum plus every group's draw.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_distributed_noise_each_service_adds_its_groups_draw_the_same_on_every_request() {
    let exact = calibrated_variance(&TaskPolicy::sample(TASK, 3));
    // Weaker noise than the policy's budget needs: no honest key service agrees to it.
    let weak = released_with(Some(exact - 1)).await;
    let refused = weak.agree(0, &weak.inputs).await;
    assert_eq!(refused.status(), 403);
    assert!(refused.text().await.unwrap().contains("no weaker noise"));

    // What the front end writes: one part in 10^4 above.
    let variance = exact + exact / 10_000 + 1;
    let m = released_with(Some(variance)).await;
    let receipts = m.agreed().await;
    let mut answers = Vec::new();
    for service in 0..3u8 {
        let (first, parsed) = m.sums(service, &receipts).await;
        let (again, _) = m.sums(service, &receipts).await;
        assert_eq!(first, again, "service {} drew other noise", service + 1);
        answers.push(parsed);
    }
    let (unmasked, exact) = m.unmasked_from(&answers, variance);
    let expected = noised(&m, variance, &exact);
    assert_eq!(unmasked.as_slice(), expected.as_slice());
    assert_ne!(unmasked.as_slice(), exact.as_slice(), "no noise at all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_services_unmask_one_agreed_set_once_and_their_sums_remove_the_masks_exactly() {
    let m = released().await;
    let layout = m.policy.masking.as_ref().unwrap().layout();

    // Before agreeing, no service sums.
    let early = m.post(0, "sums", &m.sums_request(0, &[], &m.inputs)).await;
    assert_eq!(early.status(), 409, "{}", early.text().await.unwrap());

    let mut receipts: Vec<UnmaskReceipt> = Vec::new();
    for service in 0..3 {
        let answer = m.agree(service, &m.inputs).await;
        assert_eq!(answer.status(), 200);
        receipts.push(answer.json().await.unwrap());
    }
    // The same set again is signed again; another set for the round is refused.
    assert_eq!(m.agree(0, &m.inputs).await.status(), 200);
    let other = m.agree(1, &m.inputs[1..]).await;
    assert_eq!(other.status(), 409);
    assert!(other.text().await.unwrap().contains("one set"));

    // Too few receipts (2-of-3 needs all three to agree): refused.
    let few = m
        .post(0, "sums", &m.sums_request(0, &receipts[..2], &m.inputs))
        .await;
    assert_eq!(few.status(), 403, "{}", few.text().await.unwrap());

    // Seeds swapped for the operator's own on one input: no token binds them.
    let mut swapped = m.inputs.clone();
    let forged = masked_input(&layout, &m.policy, &crate::common::issuer::signer(), 99);
    swapped[2].seeds = forged.seeds;
    let bad = m
        .post(0, "sums", &m.sums_request(0, &receipts, &swapped))
        .await;
    assert_eq!(bad.status(), 403);
    assert!(bad.text().await.unwrap().contains("device token"));

    // Seeds sealed under another policy text (as devices shown another policy than the one the
    // release pinned would seal them), with a token that verifies: they do not open.
    let mut elsewhere = m.policy.clone();
    elsewhere.plan = r#"{"shown":"to devices"}"#.into();
    let resealed = masked_input(&layout, &elsewhere, &crate::common::issuer::signer(), 1);
    let mut other_policy = m.inputs.clone();
    let at = other_policy
        .iter()
        .position(|i| i.assignment_ref == resealed.assignment_ref)
        .unwrap();
    other_policy[at] = resealed;
    let other = m
        .post(0, "sums", &m.sums_request(0, &receipts, &other_policy))
        .await;
    assert_eq!(other.status(), 403);
    assert!(other.text().await.unwrap().contains("seeds do not open"));

    // Every service's sums remove the masks of the included inputs exactly.
    let (unmasked, exact) = m.unmasked_by_all(&receipts, 0).await;
    assert_eq!(unmasked, exact);

    // Restarted from its audit log, a service still refuses another set for the round.
    let restarted = m
        .world
        .service(2, Behaviour::Honest, &m.world.share_files[1..=1])
        .with_masking_key(PrivateKey::from_bytes(m.masking_keys[1].as_bytes()).unwrap());
    let url = serve(routes::router(restarted)).await;
    let request = AgreeRequest {
        round: m.round(),
        included: refs(&m.inputs[..DEVICES - 1]),
    };
    let again = confed_protocol::http::client(TIMEOUT)
        .post(format!("{url}/v1/keys/{}/unmask/agree", m.world.key.key_id))
        .json(&request)
        .send()
        .await
        .unwrap();
    assert_eq!(again.status(), 409);
    assert!(again.text().await.unwrap().contains("one set"));
}
