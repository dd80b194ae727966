//! This key service's masking key (docs/secure-aggregation.md): the X25519 key devices seal their
//! mask seeds to. It is not a share of anything: each key service has its own, published in its
//! key set with its signature (`confed_protocol::masking_keys`). The file holds the private key
//! as unpadded base64url of its 32 bytes and one line break, mode 0600; it is created on the
//! first start and never replaced, since every masked task's policy names the public half and
//! the seeds sealed to it are stored for as long as the task's contributions are.

use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::hpke::{PrivateKey, generate_keypair};
use zeroize::Zeroizing;

use crate::{BoxError, KeyServiceError};

/// Reads the masking key at `path`, or creates one there if there is no file.
pub fn load_or_create_masking_key(path: &Path) -> Result<PrivateKey, KeyServiceError> {
    let error = |source: BoxError| KeyServiceError::MaskingKey {
        path: path.display().to_string(),
        source,
    };
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let text = Zeroizing::new(text);
            let bytes = Zeroizing::new(
                URL_SAFE_NO_PAD
                    .decode(text.trim_end_matches('\n'))
                    .map_err(|e| error(format!("not base64url: {e}").into()))?,
            );
            PrivateKey::from_bytes(&bytes).map_err(|e| error(e.into()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let (private, _) = generate_keypair();
            let text = Zeroizing::new(format!("{}\n", URL_SAFE_NO_PAD.encode(private.as_bytes())));
            crate::keys::files::write_new(path, text.as_bytes(), true)?;
            tracing::info!(path = %path.display(), "created a new masking key");
            Ok(private)
        }
        Err(e) => Err(error(e.into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_masking_key_is_created_once_and_read_back_the_same() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("masking.key");
        let created = load_or_create_masking_key(&path).unwrap();
        let again = load_or_create_masking_key(&path).unwrap();
        assert_eq!(created.as_bytes(), again.as_bytes());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&path).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn a_masking_key_file_that_is_not_a_key_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("masking.key");
        std::fs::write(&path, "not a key\n").unwrap();
        let error = load_or_create_masking_key(&path).unwrap_err().to_string();
        assert!(error.contains("masking.key"), "{error}");
    }
}
