//! A masked round of a task that requires device tokens: a contribution counts only when its
//! token's nonce binds its own encapsulated key and the seeds it sealed to each key service
//! (docs/secure-aggregation.md, "The seeds must be the device's"). An operator (or a broken
//! enclave) that swaps in seeds of its own needs a token of its own.

use confed_protocol::device_auth::DeviceAuth;
use confed_protocol::hpke_ephemeral::Ephemeral;
use confed_protocol::masking::{
    Layout, MaskContext, Ring, SealedSeeds, Seed, encode_masked, seal_seeds,
};
use confed_protocol::privacy_pass::Token;
use confed_protocol::privacy_pass::context::{encoded_round_challenge, token_nonce};
use confed_protocol::privacy_pass::issuance::{TokenClient, TokenSigner};

use super::*;
use crate::aggregate::auth_tests::{ISSUER, signer};
use crate::aggregate::tests::{KEY, ROUND, TASK, binding, context, round};
use crate::envelope;
use crate::hpke::{PublicKey, generate_keypair};

const VALUES: usize = 8;

fn token(signer: &TokenSigner, assignment_ref: &str, nonce: [u8; 32]) -> Token {
    let client = TokenClient::from_spki(signer.spki()).unwrap();
    let challenge = encoded_round_challenge(ISSUER, TASK, ROUND, assignment_ref).unwrap();
    let (request, pending) = client.begin_with_nonce(&challenge, nonce).unwrap();
    client
        .finish(pending, &signer.sign(&request).unwrap())
        .unwrap()
}

fn sealed_seeds(layout: &Layout, public: &[PublicKey], assignment_ref: &str) -> Vec<SealedSeeds> {
    let ctx = MaskContext::new(TASK, ROUND, assignment_ref, super::tests::POLICY, VALUES).unwrap();
    let seeds: Vec<Seed> = layout.groups().iter().map(|_| Seed::random()).collect();
    seal_seeds(layout, &seeds, public, &ctx).unwrap()
}

#[test]
fn a_masked_contribution_counts_only_under_a_token_that_binds_its_own_seeds() {
    let r = round(VALUES);
    let signer = signer();
    let auth = DeviceAuth::new(ISSUER, vec![signer.spki().to_vec()]).unwrap();
    let layout = Layout::new(3, 2).unwrap();
    let public: Vec<PublicKey> = (0..3).map(|_| generate_keypair().1).collect();
    let enclave = MaskedAggregator::new(binding(), layout.clone(), VALUES, &r.private)
        .unwrap()
        .authenticating(Some(auth));
    let update = encode_masked(&[7; VALUES], Ring::Bits64);
    let seal = |id: &str, nonce_of: &dyn Fn(&Ephemeral, &[SealedSeeds]) -> [u8; 32]| {
        let assignment_ref = envelope::assignment_ref(id);
        let seeds = sealed_seeds(&layout, &public, &assignment_ref);
        let ephemeral = Ephemeral::generate().unwrap();
        let token = token(&signer, &assignment_ref, nonce_of(&ephemeral, &seeds));
        let sealed = envelope::seal_masked(
            envelope::MaskedBinding {
                ephemeral,
                token: &token,
                seeds: &seeds,
            },
            &r.public,
            KEY,
            &context(ROUND),
            &id.into(),
            &update,
        );
        (assignment_ref, sealed)
    };

    // An honest device: the token binds its envelope key and its seeds.
    let honest = |e: &Ephemeral, s: &[SealedSeeds]| envelope::masked_nonce(e.encapsulated_key(), s);
    let (reference, sealed) = seal("d1", &honest);
    let mut stored = sealed.unwrap();
    assert_eq!(enclave.add(&reference, Some(&stored.to_cbor())), Ok(()));

    // The same upload with seeds the operator sealed itself in place of the device's.
    let (reference2, sealed2) = seal("d2", &honest);
    let mut swapped = sealed2.unwrap();
    swapped.seeds = Some(confed_protocol::masking::envelope_seeds(&sealed_seeds(
        &layout,
        &public,
        &reference2,
    )));
    assert_eq!(
        enclave.add(&reference2, Some(&swapped.to_cbor())),
        Err(Exclusion::Unauthenticated)
    );

    // A token of the unmasked kind (its nonce binds the envelope key only): the device library
    // refuses to seal with it, and an envelope built around it anyway does not count.
    let (_, refused) = seal("d3", &|e: &Ephemeral, _: &[SealedSeeds]| {
        token_nonce(e.encapsulated_key())
    });
    assert!(refused.unwrap_err().to_string().contains("seeds"));
    let reference3 = envelope::assignment_ref("d3");
    let ephemeral = Ephemeral::generate().unwrap();
    let plain = token(
        &signer,
        &reference3,
        token_nonce(ephemeral.encapsulated_key()),
    );
    let mut unbound = envelope::seal_with_token(
        ephemeral,
        &plain,
        &r.public,
        KEY,
        &context(ROUND),
        &"d3".into(),
        &update,
    )
    .unwrap();
    unbound.seeds = Some(confed_protocol::masking::envelope_seeds(&sealed_seeds(
        &layout,
        &public,
        &reference3,
    )));
    assert_eq!(
        enclave.add(&reference3, Some(&unbound.to_cbor())),
        Err(Exclusion::Unauthenticated)
    );

    // Seeds cut off: excluded before any token or decryption work.
    stored.seeds = stored.seeds.map(|s| s[..s.len() - 1].to_vec());
    assert_eq!(
        enclave.add(&reference, Some(&stored.to_cbor())),
        Err(Exclusion::MalformedEnvelope)
    );
    assert_eq!(enclave.counts(), (1, 3));
}
