//! Privacy Pass issuance of token type 0x0002 (RFC 9578, section 6; RFC 9474
//! RSABSSA-SHA384-PSS-Deterministic): the device blinds a token input and unblinds the issuer's
//! answer; the issuer signs blinded messages it cannot read.
//!
//! The RSA arithmetic is `blind-rsa-signatures` (docs/dependencies.md: constant-time
//! `crypto-bigint` underneath; the issuer's private-key operation runs on attacker-chosen input).
//! Every token the device finishes is verified with the issuer key before it is kept, as RFC 9474
//! requires of the client.

use blind_rsa_signatures::{
    BlindSignature, BlindingResult, DefaultRng, KeyPairSha384PSSDeterministic,
    PublicKeySha384PSSDeterministic, SecretKeySha384PSSDeterministic,
};
use sha2::{Digest, Sha256};
use thiserror::Error;
use zeroize::Zeroize;

use super::{AUTHENTICATOR_BYTES, IssuerKey, Token, TokenError, TokenRequest, TokenResponse};

/// Modulus length of every issuer key (token type 0x0002 is RSA-2048 only).
pub const MODULUS_BITS: usize = 2048;

#[derive(Debug, Error)]
pub enum IssuanceError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error("the issuer key is not an RSA-2048 RSASSA-PSS key usable for blind signatures")]
    Key,
    #[error("the issuer's private key is not a PKCS#8 PEM RSA-2048 key: {0}")]
    SecretKey(String),
    #[error("blinding the token input failed: {0}")]
    Blind(String),
    #[error("the token request names key id ...{got:02x}, this issuer's key ends ...{want:02x}")]
    WrongKey { got: u8, want: u8 },
    #[error("the blinded message is not below the issuer's modulus")]
    BlindedMessage,
    #[error("the issuer's answer does not unblind to a valid signature on the token")]
    BadResponse,
}

/// A device's half-made token: the token input it blinded and the secret to unblind the answer.
pub struct PendingToken {
    token: Token,
    blinding: BlindingResult,
}

impl Drop for PendingToken {
    fn drop(&mut self) {
        self.blinding.secret.0.zeroize();
    }
}

/// What a device holds of an issuer: its public key, for blinding and checking the answer.
pub struct TokenClient {
    key: IssuerKey,
    blind_key: PublicKeySha384PSSDeterministic,
}

impl TokenClient {
    /// From the issuer's DER SubjectPublicKeyInfo (RSASSA-PSS OID).
    pub fn from_spki(spki: &[u8]) -> Result<Self, IssuanceError> {
        let key = IssuerKey::from_spki(spki)?;
        let blind_key =
            PublicKeySha384PSSDeterministic::from_spki(spki).map_err(|_| IssuanceError::Key)?;
        if blind_key.components().n().len() * 8 != MODULUS_BITS {
            return Err(IssuanceError::Key);
        }
        Ok(Self { key, blind_key })
    }

    pub fn issuer_key(&self) -> &IssuerKey {
        &self.key
    }

    /// Starts a token for `challenge` (encoded) with a fresh random nonce.
    pub fn begin(&self, challenge: &[u8]) -> Result<(TokenRequest, PendingToken), IssuanceError> {
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| IssuanceError::Blind(e.to_string()))?;
        self.begin_with_nonce(challenge, nonce)
    }

    /// Starts a token for `challenge` (encoded) with `nonce` (confed's: `context::token_nonce` of
    /// the envelope's encapsulated key): the token input blinded. The request goes to the issuer;
    /// the pending token stays on the device.
    pub fn begin_with_nonce(
        &self,
        challenge: &[u8],
        nonce: [u8; 32],
    ) -> Result<(TokenRequest, PendingToken), IssuanceError> {
        let token = Token {
            nonce,
            challenge_digest: Sha256::digest(challenge).into(),
            token_key_id: self.key.token_key_id,
            authenticator: [0u8; AUTHENTICATOR_BYTES],
        };
        let blinding = self
            .blind_key
            .blind(&mut DefaultRng, token.input())
            .map_err(|e| IssuanceError::Blind(e.to_string()))?;
        let blinded_msg = blinding
            .blind_message
            .0
            .as_slice()
            .try_into()
            .map_err(|_| IssuanceError::Key)?;
        let request = TokenRequest {
            truncated_token_key_id: self.key.truncated_id(),
            blinded_msg,
        };
        Ok((request, PendingToken { token, blinding }))
    }

    /// Unblinds the issuer's answer into a token and verifies it before handing it out.
    pub fn finish(
        &self,
        pending: PendingToken,
        response: &TokenResponse,
    ) -> Result<Token, IssuanceError> {
        let signature = self
            .blind_key
            .finalize(
                &BlindSignature(response.blind_sig.to_vec()),
                &pending.blinding,
                pending.token.input(),
            )
            .map_err(|_| IssuanceError::BadResponse)?;
        let mut token = pending.token.clone();
        token.authenticator = signature
            .0
            .as_slice()
            .try_into()
            .map_err(|_| IssuanceError::BadResponse)?;
        Ok(token)
    }
}

/// An issuer's signing key.
pub struct TokenSigner {
    secret: SecretKeySha384PSSDeterministic,
    spki: Vec<u8>,
    key: IssuerKey,
}

impl TokenSigner {
    /// A fresh RSA-2048 key (seconds of prime search).
    pub fn generate() -> Result<Self, IssuanceError> {
        let pair = KeyPairSha384PSSDeterministic::generate(&mut DefaultRng, MODULUS_BITS)
            .map_err(|e| IssuanceError::SecretKey(e.to_string()))?;
        Self::from_secret(pair.sk)
    }

    /// From a PKCS#8 (or PKCS#1) PEM private key.
    pub fn from_pem(pem: &str) -> Result<Self, IssuanceError> {
        let secret = SecretKeySha384PSSDeterministic::from_pem(pem)
            .map_err(|e| IssuanceError::SecretKey(e.to_string()))?;
        Self::from_secret(secret)
    }

    fn from_secret(secret: SecretKeySha384PSSDeterministic) -> Result<Self, IssuanceError> {
        let public = secret.public_key().map_err(|_| IssuanceError::Key)?;
        if public.components().n().len() * 8 != MODULUS_BITS {
            return Err(IssuanceError::Key);
        }
        let spki = public.to_spki().map_err(|_| IssuanceError::Key)?;
        let key = IssuerKey::from_spki(&spki)?;
        Ok(Self { secret, spki, key })
    }

    /// The PKCS#8 PEM of the private key (write it to an owner-only file).
    pub fn to_pem(&self) -> Result<zeroize::Zeroizing<String>, IssuanceError> {
        self.secret
            .to_pem()
            .map(zeroize::Zeroizing::new)
            .map_err(|e| IssuanceError::SecretKey(e.to_string()))
    }

    /// The PKCS#8 DER of the private key (for another implementation of the private operation,
    /// e.g. the issuer's AWS-LC signer).
    pub fn pkcs8_der(&self) -> Result<zeroize::Zeroizing<Vec<u8>>, IssuanceError> {
        self.secret
            .to_der()
            .map(zeroize::Zeroizing::new)
            .map_err(|e| IssuanceError::SecretKey(e.to_string()))
    }

    /// The DER SubjectPublicKeyInfo (RSASSA-PSS OID) devices and origins are given.
    pub fn spki(&self) -> &[u8] {
        &self.spki
    }

    pub fn issuer_key(&self) -> &IssuerKey {
        &self.key
    }

    /// Signs one blinded message. The request must name this key; the signature is checked
    /// before it leaves (the library verifies its CRT result against the public key).
    pub fn sign(&self, request: &TokenRequest) -> Result<TokenResponse, IssuanceError> {
        if request.truncated_token_key_id != self.key.truncated_id() {
            return Err(IssuanceError::WrongKey {
                got: request.truncated_token_key_id,
                want: self.key.truncated_id(),
            });
        }
        let signature = self
            .secret
            .blind_sign(request.blinded_msg)
            .map_err(|_| IssuanceError::BlindedMessage)?;
        Ok(TokenResponse {
            blind_sig: signature
                .0
                .as_slice()
                .try_into()
                .map_err(|_| IssuanceError::BlindedMessage)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use blind_rsa_signatures::{BlindMessage, Secret};

    /// The RFC 9578 type 0x0002 vectors (generated by the Go implementation). `unblinder` is not
    /// in the source file: it is the inverse of the vector's `blind` modulo the key's modulus,
    /// computed once when the fixture was written, because the library keeps the inverse.
    fn cases() -> Vec<std::collections::BTreeMap<String, String>> {
        serde_json::from_str(include_str!(
            "../../testdata/privacy_pass_type2_vectors.json"
        ))
        .unwrap()
    }

    #[test]
    fn the_issuer_signs_the_vectors_blinded_messages_to_their_responses() {
        for case in cases() {
            let bytes = |k: &str| hex::decode(&case[k]).unwrap();
            let signer = TokenSigner::from_pem(&case["skS_pem"]).unwrap();
            assert_eq!(signer.spki(), bytes("pkS").as_slice());
            let request = TokenRequest::decode(&bytes("token_request")).unwrap();
            let response = signer.sign(&request).unwrap();
            assert_eq!(response.encode(), bytes("token_response"));
        }
    }

    #[test]
    fn the_device_unblinds_the_vectors_responses_to_their_tokens() {
        for case in cases() {
            let bytes = |k: &str| hex::decode(&case[k]).unwrap();
            let client = TokenClient::from_spki(&bytes("pkS")).unwrap();
            let expected = Token::decode(&bytes("token")).unwrap();
            let request = TokenRequest::decode(&bytes("token_request")).unwrap();
            let pending = PendingToken {
                token: Token {
                    authenticator: [0; AUTHENTICATOR_BYTES],
                    ..expected.clone()
                },
                blinding: BlindingResult {
                    blind_message: BlindMessage(request.blinded_msg.to_vec()),
                    secret: Secret(bytes("unblinder")),
                    msg_randomizer: None,
                },
            };
            let response = TokenResponse::decode(&bytes("token_response")).unwrap();
            assert_eq!(client.finish(pending, &response).unwrap(), expected);
        }
    }

    #[test]
    fn a_token_issued_end_to_end_verifies_and_the_issuer_saw_none_of_it() {
        let case = &cases()[0];
        let signer = TokenSigner::from_pem(&case["skS_pem"]).unwrap();
        let client = TokenClient::from_spki(signer.spki()).unwrap();
        let challenge =
            super::super::context::encoded_round_challenge("issuer.example", "t", 1, "a").unwrap();
        let (request, pending) = client.begin(&challenge).unwrap();
        let nonce = pending.token.nonce;
        let response = signer.sign(&request).unwrap();
        let token = client.finish(pending, &response).unwrap();
        signer.issuer_key().verify(&token, &challenge).unwrap();
        // Blinding: neither the token's input nor its authenticator appears in what the issuer
        // saw or answered.
        let seen = [request.encode(), response.encode()].concat();
        for secret in [
            &nonce[..],
            &token.challenge_digest[..],
            &token.authenticator[..16],
        ] {
            assert!(!seen.windows(secret.len()).any(|w| w == secret));
        }
        // A second token for the same challenge is a different token.
        let (request2, pending2) = client.begin(&challenge).unwrap();
        assert_ne!(request2.blinded_msg, request.blinded_msg);
        let token2 = client
            .finish(pending2, &signer.sign(&request2).unwrap())
            .unwrap();
        assert_ne!(token2.nonce, token.nonce);
    }

    #[test]
    fn a_wrong_key_a_forged_answer_and_an_oversized_blinded_message_are_refused() {
        let case = &cases()[0];
        let signer = TokenSigner::from_pem(&case["skS_pem"]).unwrap();
        let client = TokenClient::from_spki(signer.spki()).unwrap();
        let (mut request, pending) = client.begin(b"challenge").unwrap();
        let mut answer = signer.sign(&request).unwrap();
        answer.blind_sig[100] ^= 1;
        assert!(matches!(
            client.finish(pending, &answer),
            Err(IssuanceError::BadResponse)
        ));
        request.truncated_token_key_id ^= 1;
        assert!(matches!(
            signer.sign(&request),
            Err(IssuanceError::WrongKey { .. })
        ));
        request.truncated_token_key_id ^= 1;
        request.blinded_msg = [0xff; AUTHENTICATOR_BYTES];
        assert!(matches!(
            signer.sign(&request),
            Err(IssuanceError::BlindedMessage)
        ));
        assert!(TokenSigner::from_pem("not a key").is_err());
    }
}
