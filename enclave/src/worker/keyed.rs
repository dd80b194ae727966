//! What a job has once its key is in: the commitment and key (`Keyed`), a round's inputs with
//! the open step's reads started with the key request (`KeyedRound`, `Opening`, `Prepared`), and
//! the signed proof its release carries.

use std::sync::Arc;

use confed_attestation::exchange::encode_verifying_key;
use confed_attestation::release::{
    ReleaseCommitment, ReleaseProof, ReleaseSignature, release_text, sign_text,
};

use super::ahead::Reads;
use crate::aggregate::inputs::Input;
use crate::aggregate::{Aggregator, Binding, Manifest, PrivacyParams};
use crate::policy::sha256_hex;

/// The release's proof: the enclave's signature over the commitment, the manifest's hash and the
/// released bytes' hash, with the key services' receipts.
pub(in crate::worker) fn signed_proof(
    manifest: &Manifest,
    commitment: ReleaseCommitment,
    signing_key: &p256::ecdsa::SigningKey,
    receipts: Vec<confed_attestation::release::Receipt>,
) -> ReleaseProof {
    let text = release_text(
        &commitment,
        &sha256_hex(&manifest.to_json()),
        &manifest.average_sha256,
    );
    ReleaseProof {
        enclave: ReleaseSignature {
            enclave_signing_key: encode_verifying_key(signing_key.verifying_key()),
            signature: sign_text(signing_key, &text),
        },
        commitment,
        receipts,
    }
}

/// A round's commitment and the key obtained against it (`key_for`).
pub(in crate::worker) struct Keyed {
    pub(in crate::worker) commitment: ReleaseCommitment,
    pub(in crate::worker) signing_key: p256::ecdsa::SigningKey,
    pub(in crate::worker) receipts: Vec<confed_attestation::release::Receipt>,
    pub(in crate::worker) private_key: Arc<crate::hpke::PrivateKey>,
    pub(in crate::worker) binding: Binding,
}

/// A training round after its key (`key_round`).
pub(in crate::worker) struct KeyedRound<'a> {
    pub(in crate::worker) privacy: PrivacyParams,
    /// The round's inputs, sorted by ref, as their digest names them.
    pub(in crate::worker) inputs: Vec<Input>,
    /// The open step's reads, started with the key request (`ahead`).
    pub(in crate::worker) reads: Option<Reads<'a>>,
    pub(in crate::worker) keyed: Keyed,
    pub(in crate::worker) continues: Option<Vec<u8>>,
}

/// A job's inputs after its key, with the open step's reads started with the key request
/// (`ahead`): what `seal_range` opens a range of.
pub(in crate::worker) struct Opening<'a> {
    pub(in crate::worker) inputs: Vec<Input>,
    pub(in crate::worker) reads: Option<Reads<'a>>,
}

/// A job after its key: what `prepare` hands the step that follows.
pub(in crate::worker) struct Prepared<'a> {
    pub(in crate::worker) privacy: PrivacyParams,
    /// The round's inputs, sorted by ref, as their digest names them.
    pub(in crate::worker) inputs: Vec<Input>,
    /// The open step's reads, started with the key request (`ahead`).
    pub(in crate::worker) reads: Option<Reads<'a>>,
    pub(in crate::worker) commitment: ReleaseCommitment,
    pub(in crate::worker) signing_key: p256::ecdsa::SigningKey,
    pub(in crate::worker) receipts: Vec<confed_attestation::release::Receipt>,
    pub(in crate::worker) private_key: Arc<crate::hpke::PrivateKey>,
    pub(in crate::worker) aggregator: Arc<Aggregator>,
}
