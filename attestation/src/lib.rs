//! Attestation for confed in the roles of RATS (RFC 9334): the enclave is the attester, each key
//! service is verifier and relying party, and a policy file in `policies/` is the appraisal policy.
//!
//! This crate depends on neither the front ends nor the enclave, so a key service operator can
//! review exactly what decides whether its share is released.

pub mod report;

pub use report::{CheckOutcome, CheckResult, VerificationReport};
