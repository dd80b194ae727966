//! The confed token issuer: the attester and issuer of Privacy Pass (RFC 9576), run by a party
//! other than the front ends' operator. A device proves its integrity with evidence bound to a
//! fresh challenge; the issuer grants it at most `tokens_per_window` blind-signed tokens of type
//! 0x0002 (RFC 9578) per window, recording the grant durably before signing. It sees only blinded
//! messages, so it cannot tell which task, round or upload a token is spent on; what it keeps is
//! the per-window count `limiter/` describes, nothing else (`docs/protocol.md`, "Device tokens";
//! `docs/threat-model.md`, "Device tokens").

pub mod attester;
pub mod challenge;
pub mod cli;
pub mod credential;
pub mod error;
pub mod limiter;
pub mod routes;
pub mod rsa_awslc;

use std::sync::Arc;

use confed_protocol::clock::{Clock, Seconds};
use confed_protocol::privacy_pass::issuance::TokenSigner;
use confed_protocol::privacy_pass::{TokenRequest, TokenResponse};
use thiserror::Error;

use crate::attester::{AttestError, Attester, Evidence, FailedCheck};
use crate::challenge::{ChallengeProblem, Challenges};
use crate::credential::Credentials;
use crate::limiter::{Exhausted, Limiter, LimiterError};

/// Most token requests one call may carry.
pub const MAX_TOKENS_PER_REQUEST: usize = 64;

#[derive(Debug, Error)]
pub enum IssueError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{}", .0.reason())]
    Challenge(ChallengeProblem),
    #[error("the device's evidence was refused")]
    Attestation(Vec<FailedCheck>),
    #[error(
        "the credential is not this issuer's, or its window ended; attest again (challenge and evidence)"
    )]
    Credential,
    #[error(
        "this device has {} tokens left in the current window, which ends at {} (Unix seconds); ask for at most that many, or after the window ends",
        .0.remaining, .0.window_ends_at
    )]
    Exhausted(Exhausted),
    #[error(transparent)]
    Storage(#[from] LimiterError),
    #[error("the issuer cannot check attestations right now: {0}")]
    AttesterUnavailable(String),
    /// The attester could not read or record its own state (App Attest's key registry).
    #[error("the attester's records are unavailable: {0}")]
    AttesterStorage(String),
    #[error("signing failed: {0}")]
    Signing(String),
}

/// What shows that a request comes from an attested device.
#[derive(Debug)]
pub enum Proof {
    Attested {
        challenge: Vec<u8>,
        evidence: Evidence,
    },
    /// The credential an earlier answer of this window gave (`credential.rs`).
    Credential(Vec<u8>),
}

/// One call's worth of token requests with what backs them.
#[derive(Debug)]
pub struct IssueRequest {
    pub proof: Proof,
    pub token_requests: Vec<TokenRequest>,
}

#[derive(Debug)]
pub struct Issued {
    pub token_responses: Vec<TokenResponse>,
    pub remaining: u32,
    pub window_ends_at: Seconds,
    pub credential: Vec<u8>,
}

pub struct Issuer {
    name: String,
    signer: TokenSigner,
    fast: rsa_awslc::AwsLcSigner,
    /// Keys held besides the first, for a rotation (`with_key`): each signs the requests that
    /// name its truncated key id.
    others: Vec<(TokenSigner, rsa_awslc::AwsLcSigner)>,
    attester: Box<dyn Attester>,
    challenges: Challenges,
    credentials: Credentials,
    limiter: Limiter,
    window_seconds: i64,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Issuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Issuer")
            .field("name", &self.name)
            .field("attester", &self.attester)
            .finish_non_exhaustive()
    }
}

impl Issuer {
    pub fn new(
        name: String,
        signer: TokenSigner,
        attester: Box<dyn Attester>,
        limiter: Limiter,
        window_seconds: i64,
        clock: Arc<dyn Clock>,
    ) -> Result<Self, IssueError> {
        let fast = aws_lc_signer(&signer)?;
        Ok(Self {
            name,
            signer,
            fast,
            others: Vec::new(),
            attester,
            challenges: Challenges::new().map_err(|e| IssueError::Signing(e.to_string()))?,
            credentials: Credentials::new(limiter.derived_key(b"confed-issuer-credential-key-v1")),
            limiter,
            window_seconds,
            clock,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn signer(&self) -> &TokenSigner {
        &self.signer
    }

    /// Holds `signer`'s key too, as during a key rotation (docs/operations.md, "Rotating a token
    /// issuer's key"): the directory lists it after the first, and requests that name it are
    /// signed with it. Refused when its truncated key id (the last byte of its key id, what a
    /// token request names) is a held key's: RFC 9578 asks issuers to keep them apart.
    pub fn with_key(mut self, signer: TokenSigner) -> Result<Self, IssueError> {
        let id = signer.issuer_key().truncated_id();
        if self
            .signers()
            .any(|held| held.issuer_key().truncated_id() == id)
        {
            return Err(IssueError::Signing(format!(
                "a held key has the same truncated key id {id:#04x}; generate another key"
            )));
        }
        let fast = aws_lc_signer(&signer)?;
        self.others.push((signer, fast));
        Ok(self)
    }

    /// Every key held, the first first.
    pub fn signers(&self) -> impl Iterator<Item = &TokenSigner> {
        std::iter::once(&self.signer).chain(self.others.iter().map(|(s, _)| s))
    }

    /// The signer of the key a request names by its truncated key id.
    fn fast_signer(&self, truncated_id: u8) -> Option<&rsa_awslc::AwsLcSigner> {
        if self.signer.issuer_key().truncated_id() == truncated_id {
            return Some(&self.fast);
        }
        self.others
            .iter()
            .find(|(s, _)| s.issuer_key().truncated_id() == truncated_id)
            .map(|(_, fast)| fast)
    }

    pub fn attester(&self) -> &dyn Attester {
        self.attester.as_ref()
    }

    pub fn now(&self) -> Seconds {
        self.clock.now_seconds()
    }

    pub fn window_seconds(&self) -> i64 {
        self.window_seconds
    }

    pub fn tokens_per_window(&self) -> u32 {
        self.limiter.tokens_per_window()
    }

    /// A fresh attestation challenge and when it stops being accepted.
    pub fn challenge(&self) -> Result<(Vec<u8>, Seconds), IssueError> {
        let now = self.clock.now_seconds();
        let challenge = self
            .challenges
            .issue(now)
            .map_err(|e| IssueError::Signing(e.to_string()))?;
        Ok((
            challenge.to_vec(),
            Seconds(now.0 + challenge::CHALLENGE_TTL_SECONDS),
        ))
    }

    /// Checks the request, the challenge and the evidence, records the grant durably, then
    /// signs. Blocking (the record is synced to disk): call it off the async runtime.
    pub fn issue(&self, request: &IssueRequest) -> Result<Issued, IssueError> {
        let count = request.token_requests.len();
        if !(1..=MAX_TOKENS_PER_REQUEST).contains(&count) {
            return Err(IssueError::BadRequest(format!(
                "token_requests must hold 1 to {MAX_TOKENS_PER_REQUEST} requests; it holds {count}"
            )));
        }
        if let Some(i) = request
            .token_requests
            .iter()
            .position(|r| self.fast_signer(r.truncated_token_key_id).is_none())
        {
            let held: Vec<String> = self
                .signers()
                .map(|s| format!("{:#04x}", s.issuer_key().truncated_id()))
                .collect();
            return Err(IssueError::BadRequest(format!(
                "token_requests[{i}] names a key this issuer does not hold (truncated key id {:#04x}; it holds {}); fetch GET /v1/directory",
                request.token_requests[i].truncated_token_key_id,
                held.join(", ")
            )));
        }
        let now = self.clock.now_seconds();
        let window = now.0.div_euclid(self.window_seconds);
        let identity = match &request.proof {
            Proof::Attested {
                challenge,
                evidence,
            } => {
                self.challenges
                    .check(challenge, now)
                    .map_err(IssueError::Challenge)?;
                if let Some(reason) = self.attester.unavailable_for(evidence, now) {
                    return Err(IssueError::AttesterUnavailable(reason));
                }
                self.attester
                    .attest(evidence, challenge, now)
                    .map_err(|error| match error {
                        AttestError::Refused(failed) => IssueError::Attestation(failed),
                        AttestError::Storage(cause) => IssueError::AttesterStorage(cause),
                    })?
            }
            Proof::Credential(credential) => self
                .credentials
                .check(credential, window)
                .ok_or(IssueError::Credential)?,
        };
        // The limiter reads the clock under its lock (and never moves back a window): a request
        // stamped before a rollover must not count in a window whose file is gone.
        let grant = self
            .limiter
            .take(&identity.0, count as u32, || self.clock.now_seconds())??;
        // The key ids were checked above; a blinded message of 0 or 1, or at or above the
        // modulus, is the device's mistake (its tokens of this grant are lost, as a crash would lose them).
        let token_responses = request
            .token_requests
            .iter()
            .map(|r| {
                self.fast_signer(r.truncated_token_key_id)
                    .and_then(|fast| fast.sign(&r.blinded_msg))
                    .map(|blind_sig| TokenResponse { blind_sig })
                    .ok_or_else(|| {
                        IssueError::BadRequest(
                            "a blinded message is 0, 1 or not below the issuer's modulus (blind a token input as RFC 9474 describes)".into(),
                        )
                    })
            })
            .collect::<Result<Vec<_>, _>>()?;
        metrics::counter!("confed_issuer_tokens_issued_total").increment(count as u64);
        Ok(Issued {
            token_responses,
            remaining: grant.remaining,
            window_ends_at: grant.window_ends_at,
            credential: self.credentials.issue(window, &identity),
        })
    }
}

impl From<Exhausted> for IssueError {
    fn from(exhausted: Exhausted) -> Self {
        Self::Exhausted(exhausted)
    }
}

/// The AWS-LC signer of `signer`'s key (the fast path every request takes).
fn aws_lc_signer(signer: &TokenSigner) -> Result<rsa_awslc::AwsLcSigner, IssueError> {
    signer
        .pkcs8_der()
        .ok()
        .and_then(|der| rsa_awslc::AwsLcSigner::from_pkcs8_der(&der))
        .ok_or_else(|| IssueError::Signing("AWS-LC cannot load the signing key".into()))
}
