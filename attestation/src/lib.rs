//! Attestation for confed in the roles of RATS (RFC 9334): the enclave is the attester, each key
//! service is verifier and relying party, and a policy file in `policies/` is the appraisal policy.
//!
//! This crate depends on neither the front ends nor the enclave, so a key service operator can
//! review exactly what decides whether its share is released.

#![forbid(unsafe_code)]

pub mod appraise;
pub mod attester;
pub mod claims;
pub mod dev;
pub mod exchange;
pub mod jwk;
pub mod jws;
pub mod keys;
pub mod policy;
pub mod release;
pub mod report;
pub mod strict_json;
pub mod unmask;
pub mod unmask_api;

pub use appraise::{Appraisal, Expectations, appraise, parse_or_refuse, sha256_hex};
pub use attester::{AttestError, Attester, ConfidentialSpaceAttester, TokenRequest};
pub use dev::DevAttester;
pub use jws::Algorithm;
pub use keys::{JwksFetcher, KeySource};
pub use policy::AppraisalPolicy;
pub use report::{CheckOutcome, CheckResult, VerificationReport};
