//! Masks beneath the enclave (docs/secure-aggregation.md): a device adds pseudorandom masks to its
//! update on the integer grid (mod 2^64) and seals each mask's seed to the key services that help
//! remove it, so the enclave only ever holds masked updates; after the round's one commitment,
//! the key services return the sums of exactly the included inputs' masks, and the masks cancel
//! from the sum exactly.
//!
//! Replicated seeds: with `n` key services of threshold `t`, the release quorum is `q = max(t,
//! ceil((n + t) / 2))`; a device draws one seed per *group*, every subset of `n - q + 1` key
//! services (`Layout`), and seals to each key service the seeds of its groups. Any `q` services
//! together hold every group's seed (a group they all miss would fit in the other `n - q`
//! services, but it has `n - q + 1` members); any `q - 1` miss the group made of exactly the other
//! `n - q + 1`. So an attacker holding the enclave and `q - 1` key services (not enough to release
//! twice, either) is missing one full-strength mask of every device, and each device's masked
//! update is uniform on the grid to it.
//!
//! Every stream is AES-128-CTR (from zero) under a key derived from the seed by AES-256 (the seed
//! as its key) of the context's SHA-256, the context naming the scheme, task, round, assignment,
//! group and length: a stream is never reused for another input, round or group, and a seed alone
//! says nothing of another. AES's key schedules are wiped when dropped (its `zeroize` feature), as
//! are seeds and stream keys.
//!
//! This module is the arithmetic. Which included set the key services sum over, and that they
//! sum over one set per round agreed by `ceil((n + q) / 2)` of them, is the key services' unmask
//! ledger's to enforce (docs/secure-aggregation.md, "Why the agreement"): without it the layout
//! alone holds only against fewer than `2q - n` colluding services.

use aes::cipher::{BlockCipherEncrypt, KeyInit, KeyIvInit, StreamCipher};
use sha2::{Digest, Sha256};
use thiserror::Error;
use zeroize::{Zeroize, Zeroizing};

use crate::hpke::{self, HpkeError, PrivateKey, PublicKey};

/// The scheme's name in policies and manifests.
pub const SCHEME: &str = "confed-masking/v1";
/// Most key services a masked layout takes: C(n, n - q + 1) groups stay a handful (35 at n = 7,
/// each a full stream per device; the layouts are tested exhaustively up to it).
pub const MAX_SERVICES: u8 = 7;
/// Bytes of a seed.
pub const SEED_BYTES: usize = 32;

pub use crate::masking_ring::{NoiseRoom, Ring, noise_value_bound};
pub use crate::masking_sums::{MaskSums, StreamKeys};

const STREAM_LABEL: &[u8] = b"confed mask stream v1";
/// The label of a seed's noise block (`masking_noise`).
const NOISE_LABEL: &[u8] = b"confed mask noise v1";
const SEEDS_INFO: &[u8] = b"confed mask seeds v1";
/// Keystream made at once when a stream is added (64 KiB: stays in L2 while it is added).
pub(crate) const STREAM_CHUNK: usize = 8 * 1024;

pub(crate) type Aes128Ctr = ctr::Ctr64BE<aes::Aes128>;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum MaskingError {
    #[error(
        "a masked layout needs 1 <= t <= n <= {MAX_SERVICES} key services (got n = {n}, t = {t})"
    )]
    Layout { n: u8, t: u8 },
    #[error("key service {0} is not one of the layout's")]
    NoSuchService(u8),
    #[error("{expected} seeds expected (one per group), got {got}")]
    Seeds { expected: usize, got: usize },
    #[error("{expected} key services' public keys expected, got {got}")]
    ServiceKeys { expected: usize, got: usize },
    #[error("the sealed seeds do not open for key service {service}: {source}")]
    SeedsOpen { service: u8, source: HpkeError },
    #[error("the sealed seeds of key service {0} are not its groups' seeds")]
    SeedsShape(u8),
    #[error(
        "no mask sum for group {group} (key services {members:?}): too few key services answered"
    )]
    Withheld { group: usize, members: Vec<u8> },
    #[error("key services {first} and {second} return different mask sums for group {group}")]
    Disagree { group: usize, first: u8, second: u8 },
    #[error(
        "the envelope's `seeds` are {got} bytes; this layout's sealed seeds are {expected} bytes"
    )]
    EnvelopeSeeds { expected: usize, got: usize },
    #[error("a vector of {got} values where the masks' context says {expected}")]
    Length { expected: usize, got: usize },
    #[error("key service {0} answered twice")]
    DuplicateAnswer(u8),
    #[error(
        "a mask context needs a task id of 1 to 64 of A-Z a-z 0-9 . _ -, and an assignment ref and a policy hash of 64 lowercase hex digits"
    )]
    Context,
    #[error(
        "the unmasked sum is outside what {included} clipped updates can add (its L2 norm exceeds what {included} x {units_per_clip} grid units allow, with room for distributed noise of norm up to {noise_norm} if the task has any): a mask sum is wrong"
    )]
    OutOfBound {
        included: u64,
        units_per_clip: i64,
        noise_norm: u64,
    },
    #[error("the noise keys take one seed per group of the key service's, in order")]
    NoiseShape,
}

/// The release quorum of `n` key services of threshold `t` (docs/architecture.md, "Availability
/// of the key services"): any two quorums share at least `t` members.
pub fn quorum(n: u8, t: u8) -> u8 {
    t.max((n + t).div_ceil(2))
}

/// Which key services (numbered 1 to `n`) hold which group's seed, and the ring the masks live in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    n: u8,
    t: u8,
    q: u8,
    /// Every subset of `n - q + 1` services, members ascending, subsets in lexicographic order.
    groups: Vec<Vec<u8>>,
    ring: Ring,
}

impl Layout {
    pub fn new(n: u8, t: u8) -> Result<Self, MaskingError> {
        if t == 0 || t > n || n > MAX_SERVICES {
            return Err(MaskingError::Layout { n, t });
        }
        let q = quorum(n, t);
        let size = usize::from(n - q + 1);
        let mut groups = Vec::new();
        let mut member: Vec<u8> = (1..=size as u8).collect();
        loop {
            groups.push(member.clone());
            // The next subset in lexicographic order: bump the rightmost member that can move.
            let Some(i) = (0..size)
                .rev()
                .find(|&i| member[i] < n - (size - 1 - i) as u8)
            else {
                break;
            };
            member[i] += 1;
            for j in i + 1..size {
                member[j] = member[j - 1] + 1;
            }
        }
        Ok(Self {
            n,
            t,
            q,
            groups,
            ring: Ring::Bits64,
        })
    }

    /// The same layout with its masks in `ring`.
    pub fn with_ring(mut self, ring: Ring) -> Self {
        self.ring = ring;
        self
    }

    pub fn ring(&self) -> Ring {
        self.ring
    }

    pub fn services(&self) -> u8 {
        self.n
    }

    pub fn threshold(&self) -> u8 {
        self.t
    }

    pub fn quorum(&self) -> u8 {
        self.q
    }

    /// The groups, each its members (1-based, ascending).
    pub fn groups(&self) -> &[Vec<u8>] {
        &self.groups
    }

    /// The indices of the groups `service` belongs to, ascending.
    pub fn groups_of(&self, service: u8) -> Vec<usize> {
        (0..self.groups.len())
            .filter(|&g| self.groups[g].contains(&service))
            .collect()
    }

    /// Whether `services` together hold every group's seed.
    pub fn covers(&self, services: &[u8]) -> bool {
        self.groups
            .iter()
            .all(|group| group.iter().any(|m| services.contains(m)))
    }

    pub(crate) fn check_service(&self, service: u8) -> Result<(), MaskingError> {
        if service == 0 || service > self.n {
            return Err(MaskingError::NoSuchService(service));
        }
        Ok(())
    }
}

/// One mask's seed; wiped when dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct Seed(Zeroizing<[u8; SEED_BYTES]>);

impl std::fmt::Debug for Seed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Seed(<redacted>)")
    }
}

impl Seed {
    /// A fresh seed from the operating system's generator.
    pub fn random() -> Self {
        let mut bytes = Zeroizing::new([0u8; SEED_BYTES]);
        getrandom::fill(bytes.as_mut_slice()).expect("the operating system's random generator");
        Self(bytes)
    }

    pub fn from_bytes(bytes: [u8; SEED_BYTES]) -> Self {
        Self(Zeroizing::new(bytes))
    }
}

/// What one input's masks are bound to: a stream is never the same for another task, round,
/// assignment or length. Its fields cannot hold the context's separator (`new` checks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MaskContext<'a> {
    task_id: &'a str,
    round: u64,
    assignment_ref: &'a str,
    policy_sha256: &'a str,
    values: usize,
}

impl<'a> MaskContext<'a> {
    /// The context of `assignment_ref`'s masked vector of `values` values in `task_id`'s
    /// `round` under the task policy whose SHA-256 is `policy_sha256`: the task id 1 to 64 of
    /// `A-Z a-z 0-9 . _ -`, the ref and the policy hash 64 lowercase hex digits. The policy hash
    /// makes seeds sealed under one policy open under no other: the key services open them
    /// under the policy their release ledger pinned, which must be the one the device accepted.
    pub fn new(
        task_id: &'a str,
        round: u64,
        assignment_ref: &'a str,
        policy_sha256: &'a str,
        values: usize,
    ) -> Result<Self, MaskingError> {
        let task_ok = (1..=64).contains(&task_id.len())
            && task_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        let ref_ok = assignment_ref.len() == 64
            && assignment_ref
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
        if !(task_ok && ref_ok && crate::hex::is_digest_hex(policy_sha256)) {
            return Err(MaskingError::Context);
        }
        Ok(Self {
            task_id,
            round,
            assignment_ref,
            policy_sha256,
            values,
        })
    }

    /// The masked vector's length.
    pub fn values(&self) -> usize {
        self.values
    }

    /// `label 0x00 task_id 0x00 decimal(round) 0x00 assignment_ref 0x00 policy_sha256 0x00
    /// decimal(values) 0x00`.
    fn bytes(&self, label: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        for part in [
            label,
            self.task_id.as_bytes(),
            self.round.to_string().as_bytes(),
            self.assignment_ref.as_bytes(),
            self.policy_sha256.as_bytes(),
            self.values.to_string().as_bytes(),
        ] {
            out.extend_from_slice(part);
            out.push(0);
        }
        out
    }

    /// The stream key of `group`'s seed: AES-256 under the seed of the block made of the first 16
    /// bytes of SHA-256(context || decimal(group) 0x00).
    pub(crate) fn stream_key(&self, seed: &Seed, group: usize) -> Zeroizing<[u8; 16]> {
        self.seed_block(STREAM_LABEL, seed, group)
    }

    /// The noise block of `group`'s seed (`masking_noise`): the stream key's derivation under
    /// the label `confed mask noise v1`. The seed is only ever an AES-256 key, and the two
    /// blocks it encrypts differ.
    pub(crate) fn noise_block(&self, seed: &Seed, group: usize) -> Zeroizing<[u8; 16]> {
        self.seed_block(NOISE_LABEL, seed, group)
    }

    /// AES-256 under `seed` of the first 16 bytes of SHA-256(context under `label` ||
    /// decimal(group) 0x00).
    fn seed_block(&self, label: &[u8], seed: &Seed, group: usize) -> Zeroizing<[u8; 16]> {
        let mut hash = Sha256::new();
        hash.update(self.bytes(label));
        hash.update(group.to_string().as_bytes());
        hash.update([0]);
        let mut block = Zeroizing::new([0u8; 16]);
        block.copy_from_slice(&hash.finalize()[..16]);
        let cipher = aes::Aes256::new_from_slice(seed.0.as_slice()).expect("a 32-byte seed");
        let mut out = aes::Block::from(*block);
        cipher.encrypt_block(&mut out);
        let mut key = Zeroizing::new([0u8; 16]);
        key.copy_from_slice(&out);
        out.zeroize();
        key
    }

    pub(crate) fn check_len(&self, len: usize) -> Result<(), MaskingError> {
        if len != self.values {
            return Err(MaskingError::Length {
                expected: self.values,
                got: len,
            });
        }
        Ok(())
    }
}

/// Adds `group`'s stream under `seed` to `out` in `ring`, value by value (value `i` of the
/// stream is its bytes `w i .. w (i + 1)`, `w` the ring's bytes, little endian); `out` must have
/// the context's length and hold reduced values, and keeps them reduced.
pub fn add_stream(
    seed: &Seed,
    context: &MaskContext<'_>,
    group: usize,
    out: &mut [u64],
    ring: Ring,
) -> Result<(), MaskingError> {
    context.check_len(out.len())?;
    let key = context.stream_key(seed, group);
    let mut cipher = Aes128Ctr::new(&(*key).into(), &[0u8; 16].into());
    let width = ring.bytes();
    let mut keystream = Zeroizing::new(vec![0u8; STREAM_CHUNK * width]);
    for chunk in out.chunks_mut(STREAM_CHUNK) {
        let bytes = &mut keystream[..chunk.len() * width];
        bytes.fill(0);
        cipher.apply_keystream(bytes);
        match ring {
            Ring::Bits64 => {
                for (value, word) in chunk.iter_mut().zip(bytes.chunks_exact(8)) {
                    *value =
                        value.wrapping_add(u64::from_le_bytes(word.try_into().expect("8 bytes")));
                }
            }
            Ring::Bits32 => {
                for (value, word) in chunk.iter_mut().zip(bytes.chunks_exact(4)) {
                    let word = u32::from_le_bytes(word.try_into().expect("4 bytes"));
                    *value = (*value as u32).wrapping_add(word).into();
                }
            }
        }
    }
    Ok(())
}

/// A device's masked update: `grid` (its clipped update on the integer grid) plus every group's
/// stream, in the layout's ring.
pub fn mask(
    layout: &Layout,
    grid: &[i64],
    seeds: &[Seed],
    context: &MaskContext<'_>,
) -> Result<Vec<u64>, MaskingError> {
    if seeds.len() != layout.groups.len() {
        return Err(MaskingError::Seeds {
            expected: layout.groups.len(),
            got: seeds.len(),
        });
    }
    context.check_len(grid.len())?;
    let ring = layout.ring;
    let mut masked: Vec<u64> = grid.iter().map(|v| ring.reduce(*v as u64)).collect();
    for (group, seed) in seeds.iter().enumerate() {
        add_stream(seed, context, group, &mut masked, ring)?;
    }
    Ok(masked)
}

/// One device's seeds for one key service, sealed to it (HPKE, the protocol's suite).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SealedSeeds {
    pub service: u8,
    pub encapsulated_key: Vec<u8>,
    pub ciphertext: Vec<u8>,
}

/// Most bytes of an envelope's `seeds`: 7 key services of 3-of-7, each in 15 groups, is 3,696.
pub const MAX_ENVELOPE_SEEDS_BYTES: usize = 8 * 1024;

impl SealedSeeds {
    /// As the envelope's `seeds` carries it: the encapsulated key, then the ciphertext.
    pub fn to_bytes(&self) -> Vec<u8> {
        [self.encapsulated_key.as_slice(), &self.ciphertext].concat()
    }

    /// Service `service`'s item of an envelope's `seeds` (`split_seeds` cut it to length).
    pub fn from_bytes(service: u8, item: &[u8]) -> Self {
        let (enc, ct) = item.split_at(hpke::KEY_BYTES.min(item.len()));
        Self {
            service,
            encapsulated_key: enc.to_vec(),
            ciphertext: ct.to_vec(),
        }
    }
}

/// Bytes of key service `service`'s sealed seeds: the encapsulated key, its groups' seeds and
/// the AEAD tag.
pub fn sealed_len(layout: &Layout, service: u8) -> usize {
    hpke::KEY_BYTES + layout.groups_of(service).len() * SEED_BYTES + 16
}

/// The envelope's `seeds`: every key service's sealed seeds, service 1 first, concatenated.
pub fn envelope_seeds(sealed: &[SealedSeeds]) -> Vec<u8> {
    sealed.iter().flat_map(SealedSeeds::to_bytes).collect()
}

/// Bytes of one input's slot in a sealed masked partition (docs/protocol.md, "Sealed
/// partition"): its ref (64 ASCII bytes), its envelope's `enc`, its token's length (u16,
/// big-endian) and the token padded with zeros to a whole token's bytes, and its `seeds` (the
/// layout's length). The store sizes masked partitions by it.
pub fn partition_slot_bytes(layout: &Layout) -> usize {
    SLOT_FIXED_BYTES + envelope_seeds_len(layout)
}

/// Bytes of a slot's ref (64 lowercase hex digits).
pub const SLOT_REF_BYTES: usize = 64;
/// Bytes of a slot before its seeds: the ref, `enc`, the token's length and the padded token.
pub const SLOT_FIXED_BYTES: usize =
    SLOT_REF_BYTES + hpke::KEY_BYTES + 2 + crate::privacy_pass::TOKEN_BYTES;

/// Bytes of an envelope's `seeds` under `layout`: every key service's sealed seeds.
pub fn envelope_seeds_len(layout: &Layout) -> usize {
    (1..=layout.n).map(|j| sealed_len(layout, j)).sum()
}

/// Cuts an envelope's `seeds` into each key service's sealed seeds (service 1 first); their
/// lengths follow from the layout, so the bytes must be exactly as long as they add up to.
pub fn split_seeds<'a>(layout: &Layout, seeds: &'a [u8]) -> Result<Vec<&'a [u8]>, MaskingError> {
    let lengths: Vec<usize> = (1..=layout.n).map(|j| sealed_len(layout, j)).collect();
    let expected = envelope_seeds_len(layout);
    if seeds.len() != expected {
        return Err(MaskingError::EnvelopeSeeds {
            expected,
            got: seeds.len(),
        });
    }
    let mut rest = seeds;
    Ok(lengths
        .into_iter()
        .map(|len| {
            let (item, after) = rest.split_at(len);
            rest = after;
            item
        })
        .collect())
}

/// Associated data of a key service's sealed seeds: the context and the service's number, so
/// seeds sealed for one input or service never open as another's.
fn seeds_aad(context: &MaskContext<'_>, service: u8) -> Vec<u8> {
    let mut aad = context.bytes(STREAM_LABEL);
    aad.extend_from_slice(service.to_string().as_bytes());
    aad.push(0);
    aad
}

/// Seals to each key service (`service_keys[i]` is service `i + 1`'s) the seeds of its groups,
/// concatenated in group order.
pub fn seal_seeds(
    layout: &Layout,
    seeds: &[Seed],
    service_keys: &[PublicKey],
    context: &MaskContext<'_>,
) -> Result<Vec<SealedSeeds>, MaskingError> {
    if seeds.len() != layout.groups.len() {
        return Err(MaskingError::Seeds {
            expected: layout.groups.len(),
            got: seeds.len(),
        });
    }
    if service_keys.len() != usize::from(layout.n) {
        return Err(MaskingError::ServiceKeys {
            expected: usize::from(layout.n),
            got: service_keys.len(),
        });
    }
    (1..=layout.n)
        .map(|service| {
            let mut plaintext = Zeroizing::new(Vec::new());
            for group in layout.groups_of(service) {
                plaintext.extend_from_slice(seeds[group].0.as_slice());
            }
            let (encapsulated_key, ciphertext) = hpke::seal(
                &service_keys[usize::from(service) - 1],
                SEEDS_INFO,
                &seeds_aad(context, service),
                &plaintext,
            )
            .map_err(|source| MaskingError::SeedsOpen { service, source })?;
            Ok(SealedSeeds {
                service,
                encapsulated_key,
                ciphertext,
            })
        })
        .collect()
}

/// A key service opens its sealed seeds: (group, seed) for each of its groups.
pub fn open_seeds(
    layout: &Layout,
    private: &PrivateKey,
    sealed: &SealedSeeds,
    context: &MaskContext<'_>,
) -> Result<Vec<(usize, Seed)>, MaskingError> {
    let service = sealed.service;
    layout.check_service(service)?;
    let mut plaintext = hpke::open(
        private,
        &sealed.encapsulated_key,
        SEEDS_INFO,
        &seeds_aad(context, service),
        &sealed.ciphertext,
    )
    .map_err(|source| MaskingError::SeedsOpen { service, source })?;
    let groups = layout.groups_of(service);
    if plaintext.len() != groups.len() * SEED_BYTES {
        plaintext.zeroize();
        return Err(MaskingError::SeedsShape(service));
    }
    Ok(groups
        .into_iter()
        .zip(plaintext.chunks_exact(SEED_BYTES))
        .map(|(group, bytes)| {
            let mut seed = Zeroizing::new([0u8; SEED_BYTES]);
            seed.copy_from_slice(bytes);
            (group, Seed(seed))
        })
        .collect())
}

/// The enclave's step: removes every group's mask sum from the masked sum. Each group's sum is
/// taken from the key services that answered and hold it, which must all agree; a group no
/// answering service holds fails (too few answered), as does an answer from a service outside the
/// layout or a service answering twice. The result, read as signed integers, must be what
/// `included` updates clipped to `units_per_clip` grid units can add up to (`A = included x
/// units_per_clip`), plus distributed noise in `room` (none: `NoiseRoom::default()`): its exact
/// integer sum of squares at most `A^2 + norm^2 + 2 A spread` (`||S + N||^2 = ||S||^2 + 2 <S,
/// N> + ||N||^2`), or a mask sum was wrong: a sum over other inputs, or any random error, leaves values spread over
/// the whole ring. A deliberate small offset from a group's only answering holder passes
/// (docs/secure-aggregation.md, "Integrity").
pub fn unmask(
    layout: &Layout,
    masked_sum: &[u64],
    answers: &[MaskSums],
    included: u64,
    units_per_clip: i64,
    room: NoiseRoom,
) -> Result<Zeroizing<Vec<i64>>, MaskingError> {
    let mut seen = Vec::with_capacity(answers.len());
    for answer in answers {
        layout.check_service(answer.service)?;
        if seen.contains(&answer.service) {
            return Err(MaskingError::DuplicateAnswer(answer.service));
        }
        seen.push(answer.service);
    }
    let mut result = Zeroizing::new(masked_sum.to_vec());
    for (group, members) in layout.groups.iter().enumerate() {
        let mut chosen: Option<(u8, &[u64])> = None;
        for answer in answers.iter().filter(|a| members.contains(&a.service)) {
            let Some((_, sum)) = answer.sums.iter().find(|(g, _)| *g == group) else {
                return Err(MaskingError::SeedsShape(answer.service));
            };
            if sum.len() != masked_sum.len() {
                return Err(MaskingError::Length {
                    expected: masked_sum.len(),
                    got: sum.len(),
                });
            }
            match chosen {
                None => chosen = Some((answer.service, sum)),
                Some((first, other)) if other != sum.as_slice() => {
                    return Err(MaskingError::Disagree {
                        group,
                        first,
                        second: answer.service,
                    });
                }
                Some(_) => {}
            }
        }
        let Some((_, sum)) = chosen else {
            return Err(MaskingError::Withheld {
                group,
                members: members.clone(),
            });
        };
        for (value, mask) in result.iter_mut().zip(sum) {
            *value = value.wrapping_sub(*mask);
        }
    }
    let ring = layout.ring;
    let unmasked: Zeroizing<Vec<i64>> = Zeroizing::new(
        result
            .iter()
            .map(|v| ring.signed(ring.reduce(*v)))
            .collect(),
    );
    // Exact: every square below 2^126, the sum saturating; the bound squared saturating too.
    let squares = unmasked.iter().fold(0u128, |acc, v| {
        acc.saturating_add(u128::from(v.unsigned_abs()).pow(2))
    });
    // Float casts saturate; NaN (never passed) would count as no noise.
    let noise_norm = room.norm.max(0.0).ceil() as u64;
    let spread = room.spread.max(0.0).ceil() as u64;
    let updates = u128::from(included).saturating_mul(u128::from(units_per_clip.unsigned_abs()));
    let bound = updates
        .saturating_mul(updates)
        .saturating_add(u128::from(noise_norm).saturating_mul(u128::from(noise_norm)))
        .saturating_add(updates.saturating_mul(u128::from(spread)).saturating_mul(2));
    if squares > bound {
        return Err(MaskingError::OutOfBound {
            included,
            units_per_clip,
            noise_norm,
        });
    }
    Ok(unmasked)
}

/// The masked update's one tensor: `confed.masked`, U64 (U32 in the ring of 2^32), shape
/// `[values]`, little endian.
pub const MASKED_TENSOR: &str = "confed.masked";

/// A masked update as the device seals it: safetensors with the one tensor `MASKED_TENSOR`, its
/// values (reduced) at the ring's width.
pub fn encode_masked(masked: &[u64], ring: Ring) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(masked.len() * ring.bytes());
    for value in masked {
        ring.write(*value, &mut bytes);
    }
    let view = safetensors::tensor::TensorView::new(ring.dtype(), vec![masked.len()], &bytes)
        .expect("a vector's bytes fit its shape");
    safetensors::serialize([(MASKED_TENSOR, view)], None).expect("one tensor serializes")
}

/// Why an opened plaintext is not a masked update of the round's length.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum MaskedProblem {
    #[error("not safetensors: {0}")]
    Format(String),
    #[error("not exactly one tensor {MASKED_TENSOR:?} of the ring's dtype and shape [{0}]")]
    Shape(usize),
}

/// The little-endian values (of `ring`'s width) of a masked update of `values` values (borrowed
/// from `plaintext`).
pub fn read_masked(plaintext: &[u8], values: usize, ring: Ring) -> Result<&[u8], MaskedProblem> {
    let tensors = safetensors::SafeTensors::deserialize(plaintext)
        .map_err(|e| MaskedProblem::Format(e.to_string()))?;
    if tensors.len() != 1 {
        return Err(MaskedProblem::Shape(values));
    }
    let view = tensors
        .tensor(MASKED_TENSOR)
        .map_err(|_| MaskedProblem::Shape(values))?;
    if view.dtype() != ring.dtype() || view.shape() != [values] {
        return Err(MaskedProblem::Shape(values));
    }
    // The view points into `plaintext`: borrow it from there.
    let data = view.data();
    let start = data.as_ptr() as usize - plaintext.as_ptr() as usize;
    Ok(&plaintext[start..start + data.len()])
}

#[cfg(test)]
#[path = "masking_tests.rs"]
mod tests;
#[cfg(test)]
#[path = "masking_vectors.rs"]
mod vectors;
