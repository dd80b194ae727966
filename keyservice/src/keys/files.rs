//! The files of the key ceremony: one share file per key service (secret, mode 0600) and a public
//! key-set file. JSON, binary values in unpadded base64url, times in Unix seconds.

use std::io::Write;
use std::path::Path;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use zeroize::{Zeroize, Zeroizing};

use super::{KeyError, valid_id};

pub const SHARE_FORMAT: &str = "confed-key-share-v1";
pub const KEY_SET_FORMAT: &str = "confed-key-set-v1";

/// The public facts about one key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PublicKeyRecord {
    pub key_id: String,
    pub suite: String,
    /// X25519 public key, base64url.
    pub public_key: String,
    pub not_before: i64,
    pub not_after: i64,
    pub threshold: u16,
    pub shares: u16,
}

/// One key service's share of one key.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShareFile {
    pub format: String,
    #[serde(flatten)]
    pub key: PublicKeyRecord,
    /// The share's x coordinate (1..=shares): which key service it is for.
    pub index: u8,
    /// `x || y`, base64url. Secret.
    pub share: String,
}

impl Drop for ShareFile {
    fn drop(&mut self) {
        self.share.zeroize();
    }
}

/// The public key-set file: every key the ceremony made in this directory.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KeySetFile {
    pub format: String,
    pub keys: Vec<PublicKeyRecord>,
}

/// A share as a key service holds it in memory.
pub struct HeldShare {
    pub key: PublicKeyRecord,
    pub index: u8,
    pub share: Zeroizing<Vec<u8>>,
}

impl std::fmt::Debug for HeldShare {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HeldShare")
            .field("key_id", &self.key.key_id)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

fn file_error(
    path: &Path,
    source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
) -> KeyError {
    KeyError::File {
        path: path.display().to_string(),
        source: source.into(),
    }
}

/// Writes a new file (refusing to replace one), fsyncs it; `secret` files get mode 0600.
pub fn write_new(path: &Path, bytes: &[u8], secret: bool) -> Result<(), KeyError> {
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::OpenOptionsExt;
        options.mode(0o600);
    }
    let mut file = options.open(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            KeyError::Exists {
                path: path.display().to_string(),
            }
        } else {
            file_error(path, e)
        }
    })?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(|e| file_error(path, e))
}

impl ShareFile {
    /// Reads a share file and checks it is consistent: format, ids, key bytes, index.
    pub fn load(path: &Path) -> Result<HeldShare, KeyError> {
        let text = Zeroizing::new(std::fs::read_to_string(path).map_err(|e| file_error(path, e))?);
        let file: ShareFile = serde_json::from_str(&text).map_err(|e| file_error(path, e))?;
        let inconsistent = |reason: &str| KeyError::Inconsistent {
            path: path.display().to_string(),
            reason: reason.to_string(),
        };
        if file.format != SHARE_FORMAT {
            return Err(inconsistent(&format!("format is not {SHARE_FORMAT}")));
        }
        if !valid_id(&file.key.key_id) {
            return Err(inconsistent("key_id is not 1-64 of A-Z a-z 0-9 . _ -"));
        }
        let public = URL_SAFE_NO_PAD
            .decode(&file.key.public_key)
            .map_err(|_| inconsistent("public_key is not base64url"))?;
        confed_protocol::hpke::PublicKey::from_bytes(&public)
            .map_err(|_| inconsistent("public_key is not an X25519 key"))?;
        let share = Zeroizing::new(
            URL_SAFE_NO_PAD
                .decode(&file.share)
                .map_err(|_| inconsistent("share is not base64url"))?,
        );
        if confed_protocol::shares::share_index(&share) != Some(file.index) || file.index == 0 {
            return Err(inconsistent("share's x coordinate differs from index"));
        }
        if share.len() != 1 + confed_protocol::hpke::KEY_BYTES {
            return Err(inconsistent("share has the wrong length for an X25519 key"));
        }
        confed_protocol::shares::check_parameters(file.key.threshold, file.key.shares)?;
        Ok(HeldShare {
            key: file.key.clone(),
            index: file.index,
            share,
        })
    }
}

impl KeySetFile {
    pub fn load(path: &Path) -> Result<Self, KeyError> {
        let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e))?;
        let file: Self = serde_json::from_str(&text).map_err(|e| file_error(path, e))?;
        if file.format != KEY_SET_FORMAT {
            return Err(file_error(path, format!("format is not {KEY_SET_FORMAT}")));
        }
        Ok(file)
    }
}
