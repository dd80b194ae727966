//! The key generation ceremony (`confed keys generate`): an HPKE key pair, its private key split
//! into N Shamir shares with threshold T, one share file per key service and the public key set.
//! Run it on a machine you trust, offline; hand each share file to its key service's operator
//! and delete it here. The whole private key is never written anywhere and is wiped from memory.

use std::path::{Path, PathBuf};

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::{hpke, shares};

use super::files::{KEY_SET_FORMAT, SHARE_FORMAT, write_new};
use super::{KeyError, KeySetFile, PublicKeyRecord, ShareFile};

#[derive(Debug, Clone)]
pub struct CeremonyOptions {
    pub shares: u16,
    pub threshold: u16,
    pub out_dir: PathBuf,
    /// Unix seconds.
    pub not_before: i64,
    pub not_after: i64,
}

#[derive(Debug, Clone)]
pub struct CeremonyOutcome {
    pub key: PublicKeyRecord,
    pub share_files: Vec<PathBuf>,
    pub key_set_file: PathBuf,
}

/// File name of key service `index`'s share of `key_id`.
pub fn share_file_name(key_id: &str, index: u8) -> String {
    format!("share-{key_id}-{index}.json")
}

pub const KEY_SET_FILE: &str = "keyset.json";

/// A production key set needs t > n/2: the key services' release ledgers keep a round to one
/// release only if any two quorums of t share a key service. `development` lifts the rule (and
/// says nothing else about the key set).
pub fn check_quorum(threshold: u16, shares: u16, development: bool) -> Result<(), KeyError> {
    if development || u32::from(threshold) * 2 > u32::from(shares) {
        Ok(())
    } else {
        Err(KeyError::MinorityThreshold { threshold, shares })
    }
}

pub fn generate(options: &CeremonyOptions) -> Result<CeremonyOutcome, KeyError> {
    shares::check_parameters(options.threshold, options.shares)?;
    if options.not_before >= options.not_after {
        return Err(KeyError::EmptyValidity);
    }
    std::fs::create_dir_all(&options.out_dir).map_err(|e| KeyError::File {
        path: options.out_dir.display().to_string(),
        source: e.into(),
    })?;
    let mut id_bytes = [0u8; 8];
    getrandom::fill(&mut id_bytes).map_err(|e| KeyError::Random(e.to_string()))?;
    let key_id = format!("k{}", confed_protocol::hex::encode(id_bytes));

    let (private, public) = hpke::generate_keypair();
    let split = shares::split(private.as_bytes(), options.threshold, options.shares)?;
    drop(private);

    let key = PublicKeyRecord {
        key_id: key_id.clone(),
        suite: hpke::SUITE.to_string(),
        public_key: URL_SAFE_NO_PAD.encode(public.0),
        not_before: options.not_before,
        not_after: options.not_after,
        threshold: options.threshold,
        shares: options.shares,
    };
    let mut share_files = Vec::new();
    for share in &split {
        let index = shares::share_index(share).expect("split yields x || y shares");
        let file = ShareFile {
            format: SHARE_FORMAT.to_string(),
            key: key.clone(),
            index,
            share: URL_SAFE_NO_PAD.encode(share.as_slice()),
        };
        let path = options.out_dir.join(share_file_name(&key_id, index));
        let text = zeroize::Zeroizing::new(
            serde_json::to_vec_pretty(&file).expect("share files serialize"),
        );
        write_new(&path, &text, true)?;
        share_files.push(path);
    }
    let key_set_file = append_to_key_set(&options.out_dir, &key)?;
    Ok(CeremonyOutcome {
        key,
        share_files,
        key_set_file,
    })
}

/// Adds the key to `keyset.json` in `dir` (creating it), replacing the file atomically.
fn append_to_key_set(dir: &Path, key: &PublicKeyRecord) -> Result<PathBuf, KeyError> {
    let path = dir.join(KEY_SET_FILE);
    let mut set = if path.exists() {
        KeySetFile::load(&path)?
    } else {
        KeySetFile {
            format: KEY_SET_FORMAT.to_string(),
            keys: Vec::new(),
        }
    };
    set.keys.push(key.clone());
    let temp = dir.join(format!(".{KEY_SET_FILE}.{}", std::process::id()));
    let _ = std::fs::remove_file(&temp);
    write_new(
        &temp,
        &serde_json::to_vec_pretty(&set).expect("key sets serialize"),
        false,
    )?;
    std::fs::rename(&temp, &path).map_err(|e| KeyError::File {
        path: path.display().to_string(),
        source: e.into(),
    })?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_minority_threshold_is_refused_unless_for_development() {
        assert!(check_quorum(3, 5, false).is_ok());
        assert!(check_quorum(2, 3, false).is_ok());
        let refused = check_quorum(2, 4, false).unwrap_err().to_string();
        assert!(refused.contains("--threshold 3"), "{refused}");
        assert!(refused.contains("--development"), "{refused}");
        assert!(check_quorum(2, 5, true).is_ok());
    }

    fn options(dir: &Path, threshold: u16, shares: u16) -> CeremonyOptions {
        CeremonyOptions {
            shares,
            threshold,
            out_dir: dir.to_path_buf(),
            not_before: 100,
            not_after: 200,
        }
    }

    #[test]
    fn shares_from_files_recover_a_key_matching_the_public_key() {
        let dir = tempfile::tempdir().unwrap();
        let outcome = generate(&options(dir.path(), 3, 5)).unwrap();
        assert_eq!(outcome.share_files.len(), 5);
        let held: Vec<_> = outcome
            .share_files
            .iter()
            .map(|p| ShareFile::load(p).unwrap())
            .collect();
        let picked: Vec<&[u8]> = [0, 2, 4]
            .iter()
            .map(|&i| held[i].share.as_slice())
            .collect();
        let secret = shares::combine(3, &picked).unwrap();
        let private = hpke::PrivateKey::from_bytes(&secret).unwrap();
        let public = URL_SAFE_NO_PAD.encode(private.public_key().unwrap().0);
        assert_eq!(public, outcome.key.public_key);
        let set = KeySetFile::load(&outcome.key_set_file).unwrap();
        assert_eq!(set.keys, vec![outcome.key.clone()]);
        // No file in the directory holds the private key.
        for entry in std::fs::read_dir(dir.path()).unwrap() {
            let text = std::fs::read(entry.unwrap().path()).unwrap();
            let needle = URL_SAFE_NO_PAD.encode(secret.as_slice());
            assert!(!String::from_utf8_lossy(&text).contains(&needle));
        }
    }

    #[test]
    fn share_files_are_private_and_never_overwritten() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let outcome = generate(&options(dir.path(), 2, 2)).unwrap();
        let mode = std::fs::metadata(&outcome.share_files[0])
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let second = generate(&options(dir.path(), 2, 3)).unwrap();
        let set = KeySetFile::load(&second.key_set_file).unwrap();
        assert_eq!(set.keys.len(), 2, "a second key is added for rotation");
        assert!(matches!(
            write_new(&outcome.share_files[0], b"x", true),
            Err(KeyError::Exists { .. })
        ));
    }

    #[test]
    fn bad_parameters_are_refused_with_the_rule() {
        let dir = tempfile::tempdir().unwrap();
        for (t, n) in [(1, 3), (4, 3), (2, 256)] {
            let error = generate(&options(dir.path(), t, n)).unwrap_err();
            assert!(
                error
                    .to_string()
                    .contains("2 <= threshold <= shares <= 255"),
                "{error}"
            );
        }
        let mut empty = options(dir.path(), 2, 3);
        empty.not_after = empty.not_before;
        assert!(matches!(generate(&empty), Err(KeyError::EmptyValidity)));
    }
}
