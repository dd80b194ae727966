//! The dev attester: mints tokens with the Confidential Space claim structure, signed (ES256) by a
//! local key that only `policies/dev.toml` trusts. It runs anywhere and PROTECTS NOTHING: whoever
//! runs it can claim anything. The production policy refuses its tokens (wrong issuer, algorithm,
//! key and hardware model).

use std::sync::Arc;

use p256::ecdsa::SigningKey;
use p256::ecdsa::signature::Signer;

use crate::attester::{AttestError, Attester, TokenFuture, TokenRequest};
use crate::claims::TokenClaims;
use crate::jwk::{Jwks, p256_public_jwk};
use crate::jws;

pub const DEV_ISSUER: &str = "urn:confed:dev-attester";
/// The hardware model dev tokens claim, which no real TEE reports and only the dev policy allows.
pub const DEV_HWMODEL: &str = "DEV_NO_TEE";
pub const DEV_KID: &str = "confed-dev-attester";
/// The project and service account every dev token names (no GCP project exists behind them).
pub const DEV_PROJECT: &str = "confed-dev-no-tee";
pub const DEV_SERVICE_ACCOUNT: &str = "dev-enclave@confed-dev-no-tee.iam.gserviceaccount.com";

/// The image digest dev tokens report: SHA-256 of the text `confed-dev-enclave`.
pub fn dev_image_digest() -> String {
    format!(
        "sha256:{}",
        crate::appraise::sha256_hex(b"confed-dev-enclave")
    )
}

/// Unix seconds, injected so tests control token times.
pub type UnixClock = Arc<dyn Fn() -> i64 + Send + Sync>;

pub struct DevAttester {
    key: SigningKey,
    clock: UnixClock,
}

impl std::fmt::Debug for DevAttester {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DevAttester(NO PROTECTION)")
    }
}

pub use crate::exchange::generate_signing_key;

impl DevAttester {
    /// The attester of a dev key file (P-256 PKCS#8 PEM), created if missing, with its public
    /// key set written next to it as `<file stem>.jwks.json` for the dev policy's `jwks_file`.
    /// Key services load that file when they start, so deployments create it first
    /// (`confed keys dev-attester`).
    pub fn from_key_file(path: &std::path::Path, clock: UnixClock) -> Result<Self, String> {
        use p256::pkcs8::{DecodePrivateKey, EncodePrivateKey, LineEnding};
        let shown = path.display();
        let key = if path.exists() {
            let pem = std::fs::read_to_string(path)
                .map_err(|e| format!("reading the dev key {shown}: {e}"))?;
            SigningKey::from_pkcs8_pem(&pem)
                .map_err(|e| format!("{shown} is not a P-256 PKCS#8 key: {e}"))?
        } else {
            let key = crate::exchange::generate_signing_key();
            let pem = key
                .to_pkcs8_pem(LineEnding::LF)
                .map_err(|e| format!("encoding the dev key: {e}"))?;
            // Owner-only, as any private key: it is a dev key, but it opens the dev key services.
            let mut options = std::fs::OpenOptions::new();
            options.write(true).create_new(true);
            #[cfg(unix)]
            std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
            std::io::Write::write_all(
                &mut options
                    .open(path)
                    .map_err(|e| format!("writing the dev key {shown}: {e}"))?,
                pem.as_bytes(),
            )
            .map_err(|e| format!("writing the dev key {shown}: {e}"))?;
            key
        };
        let attester = Self::new(key, clock);
        let jwks = path.with_extension("jwks.json");
        std::fs::write(&jwks, attester.jwks_json().to_string())
            .map_err(|e| format!("writing {}: {e}", jwks.display()))?;
        Ok(attester)
    }

    pub fn new(key: SigningKey, clock: UnixClock) -> Self {
        // Loud, through the process's log (every binary shows warnings by default), not
        // printed by the library past whatever the binary decided about its output.
        tracing::warn!(
            "the confed DEV ATTESTER is in use. Its tokens are signed by a local key and prove \
             nothing about the code or machine; only the dev policy accepts them. Never use it \
             with real data."
        );
        Self { key, clock }
    }

    /// The key set the dev policy must trust to accept this attester's tokens.
    pub fn jwks(&self) -> Jwks {
        Jwks::from_json(&self.jwks_json().to_string()).expect("own key is a valid JWK")
    }

    pub fn jwks_json(&self) -> serde_json::Value {
        serde_json::json!({"keys": [p256_public_jwk(DEV_KID, self.key.verifying_key())]})
    }

    /// Signs arbitrary claims with the dev key (tests use this to build bad tokens).
    pub fn sign(&self, claims: &TokenClaims) -> String {
        sign_es256(&self.key, DEV_KID, claims)
    }

    pub fn claims_for(&self, request: &TokenRequest) -> TokenClaims {
        let mut claims = TokenClaims::confidential_space(
            DEV_ISSUER,
            &request.audience,
            request.nonces.clone(),
            (self.clock)(),
        );
        claims.hwmodel = DEV_HWMODEL.into();
        claims.secboot = false;
        claims.image_digest = Some(dev_image_digest());
        claims.project_id = DEV_PROJECT.into();
        claims.service_accounts = vec![DEV_SERVICE_ACCOUNT.into()];
        claims
    }
}

/// An ES256 token over `claims`.
pub fn sign_es256(key: &SigningKey, kid: &str, claims: &TokenClaims) -> String {
    let header = serde_json::json!({"alg": "ES256", "kid": kid, "typ": "JWT"});
    jws::encode(&header, &claims.to_json(), |message| {
        let signature: p256::ecdsa::Signature = key.sign(message);
        signature.to_bytes().to_vec()
    })
}

impl Attester for DevAttester {
    fn token<'a>(&'a self, request: &'a TokenRequest) -> TokenFuture<'a> {
        Box::pin(async move {
            request.check()?;
            Ok::<_, AttestError>(self.sign(&self.claims_for(request)))
        })
    }
}

#[cfg(test)]
mod key_file_tests {
    use super::*;

    #[test]
    fn a_new_dev_key_file_is_owner_only_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dev-attester.pem");
        let first = DevAttester::from_key_file(&path, std::sync::Arc::new(|| 0)).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "the private key is owner-only");
        }
        let again = DevAttester::from_key_file(&path, std::sync::Arc::new(|| 0)).unwrap();
        assert_eq!(
            first.jwks_json(),
            again.jwks_json(),
            "the same key, read back"
        );
        assert!(path.with_extension("jwks.json").exists());
    }
}
