//! Aggregation of a task that requires device tokens: only contributions carrying a token bound
//! to their own envelope, task, round and assignment are added, `min_reports` counts only them,
//! and the manifest says how many were authenticated.

use confed_protocol::device_auth::DeviceAuth;
use confed_protocol::hpke_ephemeral::Ephemeral;
use confed_protocol::privacy_pass::context::{encoded_round_challenge, token_nonce};
use confed_protocol::privacy_pass::issuance::{TokenClient, TokenSigner};

use super::tests::{KEY, ROUND, Round, binding, context, privacy, round, sealed, update};
use super::*;
use crate::envelope;

pub(crate) const ISSUER: &str = "issuer.test";

pub(crate) fn signer() -> TokenSigner {
    let cases: Vec<std::collections::BTreeMap<String, String>> = serde_json::from_str(
        include_str!("../../../protocol/testdata/privacy_pass_type2_vectors.json"),
    )
    .unwrap();
    TokenSigner::from_pem(&cases[0]["skS_pem"]).unwrap()
}

/// What an honest device does: draw the ephemeral key, obtain a token for it and its
/// assignment, seal with both.
fn authenticated(
    r: &Round,
    signer: &TokenSigner,
    assignment_id: &str,
    round: u64,
    plaintext: &[u8],
) -> (String, Vec<u8>) {
    let client = TokenClient::from_spki(signer.spki()).unwrap();
    let assignment_ref = envelope::assignment_ref(assignment_id);
    let ephemeral = Ephemeral::generate().unwrap();
    let challenge =
        encoded_round_challenge(ISSUER, super::tests::TASK, round, &assignment_ref).unwrap();
    let (request, pending) = client
        .begin_with_nonce(&challenge, token_nonce(ephemeral.encapsulated_key()))
        .unwrap();
    let token = client
        .finish(pending, &signer.sign(&request).unwrap())
        .unwrap();
    let sealed = envelope::seal_with_token(
        ephemeral,
        &token,
        &r.public,
        KEY,
        &context(round),
        &assignment_id.into(),
        plaintext,
    )
    .unwrap();
    (assignment_ref, sealed.to_cbor())
}

fn aggregator(r: &Round, auth: &DeviceAuth) -> Aggregator {
    Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private)
        .unwrap()
        .authenticating(Some(auth.clone()))
}

#[test]
fn only_contributions_with_their_own_token_count_and_the_manifest_says_how_many() {
    let r = round(4);
    let signer = signer();
    let auth = DeviceAuth::new(ISSUER, vec![signer.spki().to_vec()]).unwrap();
    let agg = aggregator(&r, &auth);
    let values = update(&[0.1, 0.0, 0.0, 0.0]);
    for id in ["d1", "d2"] {
        let (reference, bytes) = authenticated(&r, &signer, id, ROUND, &values);
        assert_eq!(agg.add(&reference, Some(&bytes)), Ok(()));
    }
    // The operator's own inputs: none, a token from another round, and a token lifted from a
    // genuine upload onto an envelope it sealed itself for the same assignment.
    let (reference, bytes) = sealed(&r, "op1", ROUND, &update(&[9.0, 9.0, 9.0, 9.0]));
    assert_eq!(
        agg.add(&reference, Some(&bytes)),
        Err(Exclusion::Unauthenticated)
    );
    let (reference, bytes) = authenticated(&r, &signer, "op2", ROUND + 1, &values);
    assert_eq!(
        agg.add(&reference, Some(&bytes)),
        Err(Exclusion::Unauthenticated)
    );
    let (reference, genuine) = authenticated(&r, &signer, "d3", ROUND, &values);
    let token = envelope::Envelope::from_cbor(&genuine).unwrap().token;
    let (_, own) = sealed(&r, "d3", ROUND, &update(&[9.0, 9.0, 9.0, 9.0]));
    let transplanted = envelope::Envelope {
        token,
        ..envelope::Envelope::from_cbor(&own).unwrap()
    };
    assert_eq!(
        agg.add(&reference, Some(&transplanted.to_cbor())),
        Err(Exclusion::Unauthenticated)
    );
    // The genuine upload moved to another assignment of the round does not count either.
    assert_eq!(
        agg.add(&envelope::assignment_ref("d4"), Some(&genuine)),
        Err(Exclusion::Unauthenticated)
    );

    let release = agg.finish(&r.private, privacy()).unwrap();
    assert_eq!(release.manifest.included, 2);
    assert_eq!(release.manifest.authenticated, Some(2));
    assert_eq!(release.manifest.excluded["unauthenticated"], 4);
}

#[test]
fn min_reports_counts_authenticated_contributions_only() {
    let r = round(4);
    let signer = signer();
    let auth = DeviceAuth::new(ISSUER, vec![signer.spki().to_vec()]).unwrap();
    let agg = aggregator(&r, &auth);
    let values = update(&[0.1, 0.0, 0.0, 0.0]);
    let (reference, bytes) = authenticated(&r, &signer, "d1", ROUND, &values);
    agg.add(&reference, Some(&bytes)).unwrap();
    for id in ["op1", "op2", "op3"] {
        let (reference, bytes) = sealed(&r, id, ROUND, &values);
        let _ = agg.add(&reference, Some(&bytes));
    }
    let params = PrivacyParams {
        min_reports: 2,
        ..privacy()
    };
    assert!(matches!(
        agg.finish(&r.private, params),
        Err(AggregateError::TooFewIncluded {
            included: 1,
            excluded: 3,
            min_reports: 2
        })
    ));
}

#[test]
fn a_task_without_device_auth_ignores_tokens_and_its_manifest_is_unchanged() {
    let r = round(4);
    let signer = signer();
    let agg = Aggregator::new(binding(), 1.0, r.schema.clone(), &r.private).unwrap();
    let values = update(&[0.1, 0.0, 0.0, 0.0]);
    let (reference, bytes) = authenticated(&r, &signer, "d1", ROUND, &values);
    agg.add(&reference, Some(&bytes)).unwrap();
    let (reference, bytes) = sealed(&r, "d2", ROUND, &values);
    agg.add(&reference, Some(&bytes)).unwrap();
    let release = agg.finish(&r.private, privacy()).unwrap();
    assert_eq!(release.manifest.authenticated, None);
    assert!(
        !String::from_utf8(release.manifest.to_json())
            .unwrap()
            .contains("authenticated")
    );
}
