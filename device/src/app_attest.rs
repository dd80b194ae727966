//! Apple App Attest on the device (`docs/protocol.md`, "Device tokens", Apple evidence): one App
//! Attest key per install, attested by Apple once, then used for assertions in later windows.
//!
//! The key moves through `Generated` (made, not yet attested: `attestKey` failed with Apple's
//! server unavailable, and Apple says to retry with the same key), `Sent` (its attestation went to
//! the issuer, which has not yet answered 200 or 429) and `Accepted`. It is dropped, and the next
//! evidence attests a new key, only when that is what Apple or the issuer say: `attestKey` failed
//! otherwise, `generateAssertion` found the key invalid (e.g. the app was restored onto another
//! phone), or the issuer refused the key itself (`key_id`, `signature`, `counter`,
//! `credential_id`). Other refusals (an expired challenge, an app the issuer does not allow) keep
//! it: a new key would not help, and every key Apple attests counts against the device.

use std::sync::Mutex;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::privacy_pass::issuer_api::{Evidence, app_attest_client_data_hash};

use crate::client::DeviceError;
use crate::tokens::Attestation;

/// The issuer's checks whose refusal means the key itself is unusable.
pub const KEY_CHECKS: [&str; 4] = ["key_id", "signature", "counter", "credential_id"];

/// How a `DCAppAttestService` call failed, as far as what to do next depends on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AppAttestError {
    /// `DCError.serverUnavailable`: try again later with the same key.
    ServerUnavailable(String),
    /// `DCError.invalidKey`: the key is gone or unusable; make a new one.
    InvalidKey(String),
    /// Anything else (`featureUnsupported`, `invalidInput`, `unknownSystemFailure`).
    Other(String),
}

impl std::fmt::Display for AppAttestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ServerUnavailable(e) => write!(f, "Apple's server is unavailable: {e}"),
            Self::InvalidKey(e) => write!(f, "the key is invalid: {e}"),
            Self::Other(e) => f.write_str(e),
        }
    }
}

/// The app's platform code for Apple App Attest (`DCAppAttestService`).
pub trait AppAttestService: Send + Sync {
    /// `generateKey`: a new key's identifier (32 bytes, the SHA-256 of its public key).
    fn generate_key(&self) -> Result<Vec<u8>, AppAttestError>;
    /// `attestKey(keyId, clientDataHash)`: the attestation object (CBOR).
    fn attest_key(
        &self,
        key_id: &[u8],
        client_data_hash: &[u8; 32],
    ) -> Result<Vec<u8>, AppAttestError>;
    /// `generateAssertion(keyId, clientDataHash)`: the assertion (CBOR).
    fn generate_assertion(
        &self,
        key_id: &[u8],
        client_data_hash: &[u8; 32],
    ) -> Result<Vec<u8>, AppAttestError>;
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Key {
    Generated(Vec<u8>),
    Sent(Vec<u8>),
    Accepted(Vec<u8>),
}

/// Apple App Attest as a device's `Attestation`.
pub struct AppleAppAttest<S> {
    service: S,
    key: Mutex<Option<Key>>,
}

impl<S> std::fmt::Debug for AppleAppAttest<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AppleAppAttest")
    }
}

impl<S: AppAttestService> AppleAppAttest<S> {
    /// A device that has no key yet: the first evidence generates and attests one.
    pub fn new(service: S) -> Self {
        Self {
            service,
            key: Mutex::new(None),
        }
    }

    /// A device that kept `key_id` from an earlier launch, its attestation accepted then.
    pub fn with_key(service: S, key_id: Vec<u8>) -> Self {
        Self {
            service,
            key: Mutex::new(Some(Key::Accepted(key_id))),
        }
    }

    /// The key id to keep across launches: set once the issuer accepted the key.
    pub fn key_id(&self) -> Option<Vec<u8>> {
        match self.key.lock().ok()?.as_ref()? {
            Key::Accepted(id) => Some(id.clone()),
            Key::Generated(_) | Key::Sent(_) => None,
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Option<Key>>, DeviceError> {
        self.key
            .lock()
            .map_err(|_| DeviceError::Token("App Attest: the key's lock is poisoned".into()))
    }
}

fn failed(error: &AppAttestError) -> DeviceError {
    DeviceError::Token(format!("App Attest: {error}"))
}

impl<S: AppAttestService> Attestation for AppleAppAttest<S> {
    fn evidence(&self, challenge: &[u8]) -> Result<Evidence, DeviceError> {
        let hash = app_attest_client_data_hash(challenge);
        let mut key = self.lock()?;
        // A key whose attestation was sent may have been registered before the answer was lost:
        // an assertion tells (the issuer refuses it by `key_id` if not, and a new key follows).
        if let Some(Key::Accepted(id) | Key::Sent(id)) = key.as_ref() {
            let id = id.clone();
            return match self.service.generate_assertion(&id, &hash) {
                Ok(assertion) => Ok(Evidence::AppleAppAttest {
                    key_id: URL_SAFE_NO_PAD.encode(&id),
                    attestation: None,
                    assertion: Some(URL_SAFE_NO_PAD.encode(assertion)),
                }),
                Err(error) => {
                    if matches!(error, AppAttestError::InvalidKey(_)) {
                        *key = None;
                    }
                    Err(failed(&error))
                }
            };
        }
        let id = match key.take() {
            Some(Key::Generated(id)) => id,
            _ => self.service.generate_key().map_err(|e| failed(&e))?,
        };
        match self.service.attest_key(&id, &hash) {
            Ok(object) => {
                *key = Some(Key::Sent(id.clone()));
                Ok(Evidence::AppleAppAttest {
                    key_id: URL_SAFE_NO_PAD.encode(&id),
                    attestation: Some(URL_SAFE_NO_PAD.encode(object)),
                    assertion: None,
                })
            }
            Err(error) => {
                // Apple: retry with the same key only when its server was unavailable.
                if matches!(error, AppAttestError::ServerUnavailable(_)) {
                    *key = Some(Key::Generated(id));
                }
                Err(failed(&error))
            }
        }
    }

    fn accepted(&self) {
        if let Ok(mut key) = self.key.lock()
            && let Some(Key::Sent(id)) = key.as_ref()
        {
            *key = Some(Key::Accepted(id.clone()));
        }
    }

    fn refused(&self, failed_checks: &[String]) {
        if failed_checks
            .iter()
            .any(|check| KEY_CHECKS.contains(&check.as_str()))
            && let Ok(mut key) = self.key.lock()
        {
            *key = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stand-in for `DCAppAttestService` that records what it was asked and fails as told.
    #[derive(Default)]
    struct FakeService {
        calls: Mutex<Vec<String>>,
        attest_fails: Mutex<Vec<AppAttestError>>,
        assert_fails: Mutex<Vec<AppAttestError>>,
    }

    impl AppAttestService for &FakeService {
        fn generate_key(&self) -> Result<Vec<u8>, AppAttestError> {
            let mut calls = self.calls.lock().unwrap();
            calls.push("generate".into());
            Ok(vec![u8::try_from(calls.len()).unwrap(); 32])
        }
        fn attest_key(&self, key_id: &[u8], hash: &[u8; 32]) -> Result<Vec<u8>, AppAttestError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("attest {}", key_id[0]));
            match self.attest_fails.lock().unwrap().pop() {
                Some(error) => Err(error),
                None => Ok(hash.to_vec()),
            }
        }
        fn generate_assertion(
            &self,
            key_id: &[u8],
            hash: &[u8; 32],
        ) -> Result<Vec<u8>, AppAttestError> {
            self.calls
                .lock()
                .unwrap()
                .push(format!("assert {}", key_id[0]));
            match self.assert_fails.lock().unwrap().pop() {
                Some(error) => Err(error),
                None => Ok(hash.to_vec()),
            }
        }
    }

    fn calls(service: &FakeService) -> Vec<String> {
        std::mem::take(&mut *service.calls.lock().unwrap())
    }

    #[test]
    fn one_key_is_attested_then_asserts_and_is_kept_only_once_the_issuer_accepted_it() {
        let service = FakeService::default();
        let attestation = AppleAppAttest::new(&service);
        let Evidence::AppleAppAttest {
            key_id,
            attestation: Some(object),
            assertion: None,
        } = attestation.evidence(b"c1").unwrap()
        else {
            panic!("an attestation first")
        };
        // clientDataHash = SHA-256("confed-app-attest-v1" 0 || challenge), as the issuer checks.
        assert_eq!(
            URL_SAFE_NO_PAD.decode(object).unwrap(),
            app_attest_client_data_hash(b"c1")
        );
        assert_eq!(attestation.key_id(), None, "not accepted yet");
        attestation.accepted();
        assert_eq!(
            attestation.key_id(),
            Some(URL_SAFE_NO_PAD.decode(&key_id).unwrap())
        );
        let Evidence::AppleAppAttest {
            assertion: Some(signed),
            attestation: None,
            ..
        } = attestation.evidence(b"c2").unwrap()
        else {
            panic!("then assertions")
        };
        assert_eq!(
            URL_SAFE_NO_PAD.decode(signed).unwrap(),
            app_attest_client_data_hash(b"c2")
        );
        // A refusal that is not about the key keeps it; one about the key drops it.
        attestation.refused(&["rp_id".into()]);
        attestation.evidence(b"c3").unwrap();
        attestation.refused(&["counter".into()]);
        assert_eq!(attestation.key_id(), None);
        attestation.evidence(b"c4").unwrap();
        assert_eq!(
            calls(&service),
            [
                "generate", "attest 1", "assert 1", "assert 1", "generate", "attest 5"
            ]
        );
        // A key kept from an earlier launch asserts at once.
        let kept = AppleAppAttest::with_key(&service, vec![9; 32]);
        kept.evidence(b"c5").unwrap();
        assert_eq!(calls(&service), ["assert 9"]);
    }

    #[test]
    fn platform_failures_keep_or_drop_the_key_as_apple_advises() {
        let service = FakeService::default();
        let attestation = AppleAppAttest::new(&service);
        // Apple's server unavailable: the same key is attested at the next try.
        service
            .attest_fails
            .lock()
            .unwrap()
            .push(AppAttestError::ServerUnavailable("down".into()));
        assert!(attestation.evidence(b"c").is_err());
        attestation.evidence(b"c").unwrap();
        assert_eq!(calls(&service), ["generate", "attest 1", "attest 1"]);
        // Any other attestation failure: a new key next time.
        let other = AppleAppAttest::new(&service);
        service
            .attest_fails
            .lock()
            .unwrap()
            .push(AppAttestError::Other("invalidInput".into()));
        assert!(other.evidence(b"c").is_err());
        other.evidence(b"c").unwrap();
        assert_eq!(
            calls(&service),
            ["generate", "attest 1", "generate", "attest 3"]
        );
        // A kept key the platform no longer has (restored onto another phone): dropped, and a
        // new one attested at the next try.
        let restored = AppleAppAttest::with_key(&service, vec![9; 32]);
        service
            .assert_fails
            .lock()
            .unwrap()
            .push(AppAttestError::InvalidKey("gone".into()));
        let error = restored.evidence(b"c").unwrap_err().to_string();
        assert!(error.contains("invalid"), "{error}");
        restored.evidence(b"c").unwrap();
        assert_eq!(calls(&service), ["assert 9", "generate", "attest 2"]);
    }
}
