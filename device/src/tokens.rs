//! Device tokens (`docs/protocol.md`, "Device tokens"): for a task whose policy requires them, the
//! device obtains one Privacy Pass token per contribution from the issuer its trust file lists,
//! bound to the assignment (its redemption context) and to the envelope it will seal (its nonce
//! is the hash of the envelope's HPKE encapsulated key, drawn now). The issuer sees only a blinded
//! message: it learns neither the task, the round, the assignment nor the token.
//!
//! The device attests once per window (`Attestation`) and presents the issuer's credential for the
//! rest of it.

use confed_protocol::clock::Seconds;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::device::AssignmentResponse;
use confed_protocol::hpke_ephemeral::Ephemeral;
use confed_protocol::privacy_pass::context::{encoded_round_challenge, token_nonce};
use confed_protocol::privacy_pass::issuance::TokenClient;
use confed_protocol::privacy_pass::issuer_api::{
    ChallengeResponse, Directory, Evidence, TokenRequestBody, TokenResponseBody,
};
use confed_protocol::privacy_pass::{Token, TokenResponse};
use confed_protocol::trust::TrustedIssuer;

use crate::client::{AcceptedPolicy, DeviceError};

/// How a device proves its integrity to the issuer.
pub trait Attestation: Send + Sync + std::fmt::Debug {
    /// Evidence bound to the issuer's `challenge`.
    fn evidence(&self, challenge: &[u8]) -> Result<Evidence, DeviceError>;

    /// The issuer took the last evidence (it answered 200, or 429: attested, but out of tokens).
    fn accepted(&self) {}

    /// The issuer refused the last evidence (403 `attestation-refused`) with these failed checks:
    /// an attestation that keeps state (App Attest's key) may start over.
    fn refused(&self, _failed_checks: &[String]) {}
}

/// The dev attestation: a P-256 key the device made itself. It proves nothing about the device,
/// and an issuer running the dev attester says so; for tests, the simulator and the demo.
#[derive(Debug)]
pub struct DevAttestation(p256::ecdsa::SigningKey);

impl DevAttestation {
    pub fn generate() -> Result<Self, DeviceError> {
        loop {
            let mut bytes = zeroize::Zeroizing::new([0u8; 32]);
            getrandom::fill(bytes.as_mut())
                .map_err(|e| DeviceError::Token(format!("no randomness: {e}")))?;
            if let Ok(key) = p256::ecdsa::SigningKey::from_slice(bytes.as_ref()) {
                return Ok(Self(key));
            }
        }
    }
}

impl Attestation for DevAttestation {
    fn evidence(&self, challenge: &[u8]) -> Result<Evidence, DeviceError> {
        Ok(Evidence::dev(&self.0, challenge))
    }
}

/// Android key attestation: `make_chain` is the app's platform code, which generates a key in
/// the Android keystore with `KeyGenParameterSpec.Builder.setAttestationChallenge(challenge)`
/// and returns `KeyStore.getCertificateChain` of it as DER certificates, the key's first.
pub struct AndroidKeyAttestation<F>(pub F);

impl<F> std::fmt::Debug for AndroidKeyAttestation<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AndroidKeyAttestation")
    }
}

impl<F> Attestation for AndroidKeyAttestation<F>
where
    F: Fn(&[u8]) -> Result<Vec<Vec<u8>>, String> + Send + Sync,
{
    fn evidence(&self, challenge: &[u8]) -> Result<Evidence, DeviceError> {
        let chain = (self.0)(challenge)
            .map_err(|e| DeviceError::Token(format!("Android key attestation: {e}")))?;
        Ok(Evidence::AndroidKeyAttestation {
            certificate_chain: chain
                .iter()
                .map(|der| URL_SAFE_NO_PAD.encode(der))
                .collect(),
        })
    }
}

/// A token for one assignment and the ephemeral key it binds: spent by sealing with both.
#[derive(Debug)]
pub struct AssignmentToken {
    pub(crate) ephemeral: Ephemeral,
    pub(crate) token: Token,
    /// In a masked task, the mask seeds the token's nonce binds (`masked.rs`).
    pub(crate) masking: Option<crate::masked::MaskingSecrets>,
}

/// One trusted issuer, as a device asks it for tokens.
#[derive(Debug)]
pub struct TokenSource {
    http: reqwest::Client,
    url: String,
    attestation: std::sync::Arc<dyn Attestation>,
    /// The credential of the current window and when it ends (Unix seconds).
    credential: Mutex<Option<(String, Seconds)>>,
    /// The token keys (DER SPKI) the issuer's directory offered when last asked; asked again
    /// when none of a policy's keys is among them, or the issuer refused a request.
    offered: Mutex<Option<Vec<Vec<u8>>>>,
}

fn unix_now() -> Seconds {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(Seconds(0), |d| {
            Seconds(i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        })
}

async fn json_or_problem<T: serde::de::DeserializeOwned>(
    response: reqwest::Response,
) -> Result<T, DeviceError> {
    if response.status().is_success() {
        return Ok(response.json().await?);
    }
    Err(crate::client::problem_detail(response).await)
}

/// How long a device waits before checking in again after an assignment it could not serve (no
/// device token, a refused upload): a failure that will fail again (an issuer that offers none
/// of a policy's keys during a rotation) must not become a loop of assignments, each of which
/// holds a slot of the round until it is reported.
pub const AFTER_FAILURE: confed_protocol::device::RetryWindow =
    confed_protocol::device::RetryWindow {
        min_seconds: 60,
        max_seconds: 120,
    };

impl TokenSource {
    pub fn new(
        http: reqwest::Client,
        issuer: &TrustedIssuer,
        attestation: std::sync::Arc<dyn Attestation>,
    ) -> Self {
        Self {
            http,
            url: issuer.url.trim_end_matches('/').to_string(),
            attestation,
            credential: Mutex::default(),
            offered: Mutex::default(),
        }
    }

    /// The issuer's token keys, from its directory (`GET /v1/directory`; kept until `forget`).
    async fn offered_keys(&self, fresh: bool) -> Result<Vec<Vec<u8>>, DeviceError> {
        if !fresh && let Some(keys) = self.offered.lock().ok().and_then(|k| k.clone()) {
            return Ok(keys);
        }
        let directory: Directory = json_or_problem(
            self.http
                .get(format!("{}/v1/directory", self.url))
                .send()
                .await?,
        )
        .await?;
        let keys: Vec<Vec<u8>> = directory
            .token_keys
            .iter()
            .filter_map(|k| URL_SAFE_NO_PAD.decode(&k.token_key).ok())
            .collect();
        if let Ok(mut held) = self.offered.lock() {
            *held = Some(keys.clone());
        }
        Ok(keys)
    }

    /// The key to ask for: the first of the policy's `token_keys` that the issuer offers (during
    /// a rotation a policy may name a key the issuer does not hold yet, or no longer). The
    /// directory is asked again once before giving up.
    async fn key_for(&self, policy_keys: &[Vec<u8>]) -> Result<Vec<u8>, DeviceError> {
        for fresh in [false, true] {
            let offered = self.offered_keys(fresh).await?;
            if let Some(key) = policy_keys.iter().find(|k| offered.contains(k)) {
                return Ok(key.clone());
            }
        }
        Err(DeviceError::Token(format!(
            "the issuer at {} offers none of the {} token keys the task's policy names (a key rotation in progress?); decline the task for now",
            self.url,
            policy_keys.len()
        )))
    }

    /// A token for `assignment` under a token key that both the accepted policy names and the
    /// issuer offers (`key_for`); in a masked task its nonce also binds `masking`'s sealed seeds.
    pub async fn obtain(
        &self,
        policy: &AcceptedPolicy,
        assignment: &AssignmentResponse,
        masking: Option<crate::masked::MaskingSecrets>,
    ) -> Result<AssignmentToken, DeviceError> {
        let auth = policy.policy.device_auth.as_ref().ok_or_else(|| {
            DeviceError::Token("the task's policy does not require device tokens".into())
        })?;
        if auth.token_keys.is_empty() {
            return Err(DeviceError::Token("the policy names no token key".into()));
        }
        let spki = self.key_for(&auth.token_keys).await?;
        let client =
            TokenClient::from_spki(&spki).map_err(|e| DeviceError::Token(e.to_string()))?;
        let round = confed_protocol::ids::wire_round(assignment.round).ok_or_else(|| {
            DeviceError::Token(format!("round {} is not a round", assignment.round))
        })?;
        let challenge = encoded_round_challenge(
            &auth.issuer,
            &assignment.task_id,
            round,
            assignment.assignment_id.reference().as_str(),
        )
        .map_err(|e| DeviceError::Token(e.to_string()))?;
        let ephemeral =
            Ephemeral::generate().map_err(confed_protocol::envelope::EnvelopeError::from)?;
        let nonce = match &masking {
            Some(secrets) => confed_protocol::envelope::masked_nonce(
                ephemeral.encapsulated_key(),
                &secrets.sealed,
            ),
            None => token_nonce(ephemeral.encapsulated_key()),
        };
        let (request, pending) = client
            .begin_with_nonce(&challenge, nonce)
            .map_err(|e| DeviceError::Token(e.to_string()))?;
        let requests = vec![URL_SAFE_NO_PAD.encode(request.encode())];
        let answer = match self.request(requests).await {
            Ok(answer) => answer,
            Err(error) => {
                // The issuer may have rotated its keys since its directory was read.
                if let Ok(mut held) = self.offered.lock() {
                    *held = None;
                }
                return Err(error);
            }
        };
        let response = answer
            .token_responses
            .first()
            .and_then(|r| URL_SAFE_NO_PAD.decode(r).ok())
            .and_then(|r| TokenResponse::decode(&r).ok())
            .ok_or_else(|| DeviceError::Token("the issuer's answer holds no token".into()))?;
        let token = client
            .finish(pending, &response)
            .map_err(|e| DeviceError::Token(e.to_string()))?;
        Ok(AssignmentToken {
            ephemeral,
            token,
            masking,
        })
    }

    /// Sends token requests with the window's credential, or attests first if there is none
    /// (or the issuer no longer takes it).
    async fn request(&self, requests: Vec<String>) -> Result<TokenResponseBody, DeviceError> {
        let held = self
            .credential
            .lock()
            .ok()
            .and_then(|c| c.clone())
            .filter(|(_, ends)| unix_now() < *ends);
        if let Some((credential, _)) = held {
            let body = TokenRequestBody {
                challenge: None,
                evidence: None,
                credential: Some(credential),
                token_requests: requests.clone(),
            };
            match self.send(&body).await {
                Err(DeviceError::Server { status: 403, .. }) => {}
                other => return other,
            }
        }
        let challenge: ChallengeResponse = json_or_problem(
            self.http
                .post(format!("{}/v1/challenge", self.url))
                .send()
                .await?,
        )
        .await?;
        let raw = URL_SAFE_NO_PAD
            .decode(&challenge.challenge)
            .map_err(|_| DeviceError::Token("the issuer's challenge is not base64url".into()))?;
        let body = TokenRequestBody {
            evidence: Some(self.attestation.evidence(&raw)?),
            challenge: Some(challenge.challenge),
            credential: None,
            token_requests: requests,
        };
        let response = self.post(&body).await?;
        let status = response.status().as_u16();
        if status == 403 {
            // The failed checks tell the attestation whether its key is what was refused.
            let text = response.text().await.unwrap_or_default();
            let problem: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
            if problem["type"] == "urn:confed:problem:attestation-refused" {
                let checks: Vec<String> = problem["failed_checks"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|c| c["check"].as_str().map(String::from))
                    .collect();
                self.attestation.refused(&checks);
            }
            let detail = problem["detail"].as_str().map_or(text, String::from);
            return Err(DeviceError::Server { status, detail });
        }
        if status == 200 || status == 429 {
            self.attestation.accepted();
        }
        self.finish(response).await
    }

    async fn post(&self, body: &TokenRequestBody) -> Result<reqwest::Response, DeviceError> {
        Ok(self
            .http
            .post(format!("{}/v1/token-request", self.url))
            .json(body)
            .send()
            .await?)
    }

    async fn send(&self, body: &TokenRequestBody) -> Result<TokenResponseBody, DeviceError> {
        let response = self.post(body).await?;
        self.finish(response).await
    }

    /// The answer, its credential kept for the rest of the window.
    async fn finish(&self, response: reqwest::Response) -> Result<TokenResponseBody, DeviceError> {
        let answer: TokenResponseBody = json_or_problem(response).await?;
        if let Ok(mut held) = self.credential.lock() {
            *held = Some((answer.credential.clone(), answer.window_ends_at));
        }
        Ok(answer)
    }
}

impl crate::client::DeviceClient {
    /// Attests to token issuers with `attestation` (`tokens::DevAttestation` for tests and
    /// demos): the device then accepts tasks that require device tokens of an issuer its trust
    /// file lists.
    pub fn with_attestation(mut self, attestation: std::sync::Arc<dyn Attestation>) -> Self {
        self.attestation = Some(attestation);
        self
    }

    /// The device token the assignment's task requires (`None` if it requires none), obtained
    /// from the trusted issuer while the device trains. In a masked task the device's mask
    /// seeds are drawn and sealed first (their number of values is `model`'s), and the token
    /// binds them.
    pub async fn token_for(
        &self,
        assignment: &AssignmentResponse,
        policy: &AcceptedPolicy,
        model: &crate::client::Model,
    ) -> Result<Option<AssignmentToken>, DeviceError> {
        let Some(issuer) =
            confed_protocol::trust::accept_device_auth(&self.token_issuers, &policy.policy)
                .map_err(|e| DeviceError::UntrustedPolicy(e.to_string()))?
        else {
            return Ok(None);
        };
        let attestation = self.attestation.clone().ok_or_else(|| {
            DeviceError::Token("this device has no attestation (with_attestation)".into())
        })?;
        let source = {
            let mut sources = self.token_sources.lock().unwrap_or_else(|p| p.into_inner());
            sources
                .entry(issuer.name.clone())
                .or_insert_with(|| {
                    std::sync::Arc::new(TokenSource::new(self.http.clone(), issuer, attestation))
                })
                .clone()
        };
        let masking = match policy.policy.masking {
            Some(_) => {
                let round =
                    confed_protocol::ids::wire_round(assignment.round).ok_or_else(|| {
                        DeviceError::Token(format!("round {} is not a round", assignment.round))
                    })?;
                Some(crate::masked::draw(
                    &policy.policy,
                    round,
                    assignment.assignment_id.reference().as_str(),
                    crate::masked::values_of(&model.bytes)?,
                )?)
            }
            None => None,
        };
        source.obtain(policy, assignment, masking).await.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn android_attestation_sends_the_platforms_chain_for_the_challenge_as_base64url() {
        let attestation = AndroidKeyAttestation(|challenge: &[u8]| {
            Ok(vec![challenge.to_vec(), vec![0xfb, 0xff]])
        });
        assert_eq!(
            attestation.evidence(b"c").unwrap(),
            Evidence::AndroidKeyAttestation {
                certificate_chain: vec!["Yw".into(), "-_8".into()]
            }
        );
        let failing = AndroidKeyAttestation(|_: &[u8]| Err("no secure hardware".into()));
        let error = failing.evidence(b"c").unwrap_err().to_string();
        assert!(error.contains("no secure hardware"), "{error}");
    }
}
