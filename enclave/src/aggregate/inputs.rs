//! A job's inputs, named by one digest before the round's key is asked for.
//!
//! The release commitment a key service records, and the key of the round's noise, name the
//! inputs by one digest: BLAKE3 over the digest of every contribution the job lists (not only of
//! those that turn out valid, which is known only after decryption; the valid ones are a function
//! of these bytes and the key). Two jobs with the same digest therefore release the same
//! bytes, and a job over any other bytes, even one swapped envelope with an unchanged ref, has
//! another digest: fresh noise, and a commitment the key services' ledger refuses for a round
//! already committed.
//!
//! ```text
//! inputs_digest = BLAKE3( for each contribution, in ascending ref order:
//!                   ref (64 ASCII hex) || 0x01 || BLAKE3(stored bytes)     (present)
//!                   ref (64 ASCII hex) || 0x00                             (missing) )
//! ```
//!
//! A contribution's BLAKE3 is the one the job lists (the server computed it once, as the upload
//! arrived) or, where the job lists none (a direct upload to the blob store), the one the worker
//! computes on a first read. Either way it is a claim until the bytes are opened: each must have
//! its committed digest then, or the job fails (`worker::open_one`). The check is not
//! redundant with the AEAD: an AEAD tag does not commit the ciphertext to the sealer who knows its
//! key (the operator can seal its own), and a garbled envelope that no longer opens would
//! otherwise be excluded from a release under noise committed for the honest one.
//!
//! The encoding is injective only because every ref has exactly 64 characters: a job whose refs
//! are not all 64 lowercase hex digits is refused before anything is digested (otherwise a ref
//! could absorb the bytes of its neighbour, and two different jobs would share a digest).
//!
//! BLAKE3 because it is collision resistant for everybody (an AEAD tag is not, for the sealer who
//! knows its key) and the fastest such hash here (8.4 GB/s per core on a cached megabyte, against
//! SHA-256's 2.0 with the SHA extensions).

use rayon::prelude::*;

/// One contribution of a job, as its digest is committed.
#[derive(Debug)]
pub struct Input {
    pub assignment_ref: String,
    pub blob_key: String,
    /// BLAKE3 of the stored bytes (listed by the job, or from the first read); `None` when the
    /// first read found none.
    pub digest: Option<[u8; 32]>,
    /// The bytes, when kept from the first read (otherwise read again and checked against
    /// `digest`).
    pub retained: Option<Vec<u8>>,
}

/// BLAKE3 of each stored contribution, on all cores.
pub fn digest_all(stored: &[Option<Vec<u8>>]) -> Vec<Option<[u8; 32]>> {
    stored
        .par_iter()
        .map(|bytes| bytes.as_deref().map(|b| *blake3::hash(b).as_bytes()))
        .collect()
}

/// The documented digest over inputs sorted by ref (see the module documentation).
pub fn inputs_digest<'a>(
    sorted: impl IntoIterator<Item = (&'a str, Option<&'a [u8; 32]>)>,
) -> String {
    let mut hasher = blake3::Hasher::new();
    for (assignment_ref, digest) in sorted {
        hasher.update(assignment_ref.as_bytes());
        match digest {
            Some(digest) => {
                hasher.update(&[1]);
                hasher.update(digest);
            }
            None => {
                hasher.update(&[0]);
            }
        }
    }
    super::hex(hasher.finalize().as_bytes())
}

/// The inputs digest of an adaptive-clipping round: the contributions' digest with the round's
/// clip norm (which the store chooses) bound in, `BLAKE3(inputs_digest (64 ASCII hex) ||
/// "clip_norm=" || {:e} of the clip norm)`, so the release commitment and the noise change with
/// it: a second release of the same inputs at another clip norm under the same noise would
/// reveal the noise.
pub fn bind_clip_norm(inputs_digest: &str, clip_norm: f64) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(inputs_digest.as_bytes());
    hasher.update(format!("clip_norm={clip_norm:e}").as_bytes());
    super::hex(hasher.finalize().as_bytes())
}

/// The inputs digest of a round evaluated on demand: `BLAKE3(inputs_digest (64 ASCII hex) ||
/// "on_demand_evaluation")`, so a release of the same inputs with and without the evaluation has
/// another commitment (which the key services' ledger admits once per round) and other noise.
pub fn bind_on_demand_evaluation(inputs_digest: &str) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(inputs_digest.as_bytes());
    hasher.update(b"on_demand_evaluation");
    super::hex(hasher.finalize().as_bytes())
}

/// The stream-to-value map of the step sampler (`noise::add_steps`, `dp::sampler_steps`) that a
/// BLT round's and a Gaussian round's release noise is drawn with, as bound into their inputs
/// digests: an enclave whose noise maps the stream to other values must name another, so that it
/// cannot finish a round an enclave of the other kind started (two releases of one round with
/// other noise would average it away). `noise`'s known-answer tests pin the values it names.
pub const STEPS_SAMPLER: &str = "steps-v1";

/// The inputs digest of a round whose policy's noise is `discrete_gaussian_on_grid`:
/// `BLAKE3(inputs_digest (64 ASCII hex) || "sampler=" || STEPS_SAMPLER)`, bound last. Enclaves
/// before it drew the release's noise with `sampler` from the same key and named no sampler:
/// their commitment for a round differs from this one's, so the key services' ledger (one
/// commitment per round) lets only one of the two release it. A masked round with distributed
/// noise (the key services' draws are its noise, the enclave draws none) names it too: the rule
/// follows the policy alone.
pub fn bind_gaussian_sampler(inputs_digest: &str) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(inputs_digest.as_bytes());
    hasher.update(b"sampler=");
    hasher.update(STEPS_SAMPLER.as_bytes());
    super::hex(hasher.finalize().as_bytes())
}

/// The inputs digest of a BLT round: `BLAKE3(inputs_digest (64 ASCII hex) || "blt_state=" ||
/// BLAKE3 hex of the sealed state it continues, or "initial" in round 1 || ";sampler=" ||
/// STEPS_SAMPLER)`. The release commitment then names the state, and the key services' ledger (one
/// commitment per round) lets each round continue exactly one: no rolled-back or forked state is
/// ever continued. It names the sampler too, so the ledger also refuses a second release of a
/// round by an enclave version that draws other noise from the same key.
pub fn bind_blt_state(inputs_digest: &str, state: Option<&[u8; 32]>) -> String {
    let mut hasher = blake3::Hasher::new();
    hasher.update(inputs_digest.as_bytes());
    hasher.update(b"blt_state=");
    match state {
        Some(digest) => hasher.update(super::hex(digest).as_bytes()),
        None => hasher.update(b"initial"),
    };
    hasher.update(b";sampler=");
    hasher.update(STEPS_SAMPLER.as_bytes());
    super::hex(hasher.finalize().as_bytes())
}

/// The inputs' listing without their bytes: what a partition's header is computed from after
/// its inputs went to be opened.
pub fn listing(inputs: &[Input]) -> Vec<Input> {
    inputs
        .iter()
        .map(|input| Input {
            assignment_ref: input.assignment_ref.clone(),
            blob_key: input.blob_key.clone(),
            digest: input.digest,
            retained: None,
        })
        .collect()
}

/// Test contributions (ref, stored bytes) as a worker commits them: sorted by ref, every one
/// kept from its first read, with the round's inputs digest.
#[cfg(test)]
pub(crate) fn committed(pairs: &[(String, Option<Vec<u8>>)]) -> (Vec<Input>, String) {
    let mut inputs: Vec<Input> = pairs
        .iter()
        .map(|(assignment_ref, bytes)| Input {
            assignment_ref: assignment_ref.clone(),
            blob_key: format!("blob/{assignment_ref}"),
            digest: bytes.as_deref().map(|b| *blake3::hash(b).as_bytes()),
            retained: bytes.clone(),
        })
        .collect();
    let digest = sort_and_digest(&mut inputs).unwrap();
    (inputs, digest)
}

/// Whether `text` is an assignment ref: exactly 64 lowercase hex digits (SHA-256 of an id).
pub fn is_ref(text: &str) -> bool {
    confed_protocol::hex::is_digest_hex(text)
}

/// Sorts inputs by ref and computes their digest; refuses (saying why) a ref that is not 64
/// lowercase hex digits or that appears twice (a store that hands one contribution twice is not
/// to be trusted with the sum).
pub fn sort_and_digest(inputs: &mut [Input]) -> Result<String, String> {
    if let Some(bad) = inputs.iter().find(|i| !is_ref(&i.assignment_ref)) {
        return Err(format!(
            "contribution ref {:?} is not 64 lowercase hex digits",
            bad.assignment_ref
        ));
    }
    inputs.sort_by(|a, b| a.assignment_ref.cmp(&b.assignment_ref));
    if let Some(pair) = inputs
        .windows(2)
        .find(|pair| pair[0].assignment_ref == pair[1].assignment_ref)
    {
        return Err(format!(
            "the job lists contribution {} twice",
            pair[0].assignment_ref
        ));
    }
    Ok(inputs_digest(inputs.iter().map(|input| {
        (input.assignment_ref.as_str(), input.digest.as_ref())
    })))
}

/// The digest of (ref, stored bytes) pairs in any order (for tests and tools).
pub fn digest_of(pairs: &[(String, Option<Vec<u8>>)]) -> String {
    let digests = digest_all(&pairs.iter().map(|(_, b)| b.clone()).collect::<Vec<_>>());
    let mut sorted: Vec<(&str, Option<&[u8; 32]>)> = pairs
        .iter()
        .zip(&digests)
        .map(|((r, _), d)| (r.as_str(), d.as_ref()))
        .collect();
    sorted.sort();
    inputs_digest(sorted)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 64-hex ref named by one letter.
    fn r(name: &str) -> String {
        format!("{:0>64}", confed_protocol::hex::encode(name))
    }

    fn input(name: &str, bytes: Option<&[u8]>) -> Input {
        Input {
            assignment_ref: r(name),
            blob_key: format!("blob-{name}"),
            digest: bytes.map(|b| *blake3::hash(b).as_bytes()),
            retained: None,
        }
    }

    /// The documented form: BLAKE3 of the digest's 64 hex characters then `sampler=steps-v1`;
    /// a Gaussian round's commitment then differs from an older enclave's (which named no
    /// sampler) and from a BLT round's over the same inputs.
    #[test]
    fn a_gaussian_rounds_digest_names_its_sampler_as_documented() {
        let digest = "ab".repeat(32);
        let bound = bind_gaussian_sampler(&digest);
        let expected = blake3::hash(format!("{digest}sampler=steps-v1").as_bytes());
        assert_eq!(bound, super::super::hex(expected.as_bytes()));
        assert_ne!(bound, digest);
        assert_ne!(bound, bind_blt_state(&digest, None));
        assert_eq!(bound, bind_gaussian_sampler(&digest));
    }

    #[test]
    fn the_digest_is_independent_of_order_and_covers_every_byte_and_absence() {
        let mut a = vec![input("r2", Some(b"two")), input("r1", Some(b"one"))];
        let mut b = vec![input("r1", Some(b"one")), input("r2", Some(b"two"))];
        let base = sort_and_digest(&mut a).unwrap();
        assert_eq!(base, sort_and_digest(&mut b).unwrap());
        let mut changed = vec![input("r1", Some(b"one")), input("r2", Some(b"twO"))];
        assert_ne!(base, sort_and_digest(&mut changed).unwrap());
        let mut missing = vec![input("r1", Some(b"one")), input("r2", None)];
        assert_ne!(base, sort_and_digest(&mut missing).unwrap());
        let mut empty = vec![input("r1", Some(b"one")), input("r2", Some(b""))];
        assert_ne!(
            sort_and_digest(&mut missing).unwrap(),
            sort_and_digest(&mut empty).unwrap(),
            "a missing contribution differs from an empty one"
        );
        assert_eq!(
            base,
            digest_of(&[
                (r("r2"), Some(b"two".to_vec())),
                (r("r1"), Some(b"one".to_vec()))
            ])
        );
    }

    #[test]
    fn a_ref_handed_twice_is_refused() {
        let mut twice = vec![input("r1", Some(b"one")), input("r1", Some(b"again"))];
        assert!(sort_and_digest(&mut twice).unwrap_err().contains("twice"));
    }

    /// The collision the review found: with refs of any length, a missing ref `v[..63]` followed
    /// by `v` encodes exactly like the one ref `v[..63] 0x00 v`. Such refs are refused.
    #[test]
    fn refs_that_are_not_64_hex_digits_are_refused() {
        let v = r("victim");
        let bytes = b"envelope";
        let digest = Some(*blake3::hash(bytes).as_bytes());
        let mut a = vec![
            Input {
                assignment_ref: v[..63].to_string(),
                blob_key: "a".into(),
                digest: None,
                retained: None,
            },
            Input {
                assignment_ref: v.clone(),
                blob_key: "v".into(),
                digest,
                retained: None,
            },
        ];
        let mut b = vec![Input {
            assignment_ref: format!("{}\u{0}{v}", &v[..63]),
            blob_key: "v".into(),
            digest,
            retained: None,
        }];
        assert!(
            sort_and_digest(&mut a)
                .unwrap_err()
                .contains("64 lowercase hex")
        );
        assert!(
            sort_and_digest(&mut b)
                .unwrap_err()
                .contains("64 lowercase hex")
        );
        for bad in ["", "ABCDEF", &"g".repeat(64), &"a".repeat(65)] {
            assert!(!is_ref(bad), "{bad}");
        }
        assert!(is_ref(&v));
    }
}
