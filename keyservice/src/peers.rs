//! The other key services this one witnesses and asks about itself (`rollback.rs`,
//! `witness.rs`): each named by its id, reached at its URL, and pinned by the verifying key it
//! signs its key set and audit heads with. Configured by the operator in a peers file:
//!
//! ```json
//! {"peers": [{"id": "ks2", "url": "https://ks2.example", "verifying_key": "BASE64URL-SEC1"}]}
//! ```

use std::path::Path;
use std::time::Duration;

use p256::ecdsa::VerifyingKey;
use serde::Deserialize;
use thiserror::Error;

use crate::audit::{Record, SignedHead};

/// What one call to a peer may take: a lost peer costs at most this per attempt.
pub const PEER_TIMEOUT: Duration = Duration::from_secs(5);
/// A signed head (or one record) is a few hundred bytes; anything larger is not one.
const MAX_ANSWER_BYTES: usize = 16 * 1024;
/// `MAX_RECORDS_PER_ANSWER` records of at most ~2 KB each.
const MAX_RECORDS_BYTES: usize = 1 << 20;

#[derive(Debug, Error)]
pub enum PeersError {
    #[error("peers file {path}: {reason}")]
    File { path: String, reason: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeersFile {
    peers: Vec<PeerEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PeerEntry {
    id: String,
    url: String,
    verifying_key: String,
}

/// One configured peer.
#[derive(Debug, Clone)]
pub struct Peer {
    pub id: String,
    /// Base URL, without a trailing slash.
    pub url: String,
    pub verifying_key: VerifyingKey,
}

/// The configured peers and the client that reaches them.
#[derive(Debug, Clone)]
pub struct Peers {
    pub list: Vec<Peer>,
    /// Answers needed before this service grants after a start (`rollback.rs`).
    pub quorum: usize,
    client: reqwest::Client,
}

/// The default start quorum: ceil(p / 2) of p peers. With t > n/2, whenever a release quorum of
/// t key services is up, each of them reaches t - 1 >= ceil((n - 1) / 2) peers, so waiting for
/// this many never stops a service that a round could use (docs/attestation.md).
pub fn default_quorum(peers: usize) -> usize {
    peers.div_ceil(2)
}

/// Reads a peers file: ids valid and unique, none of them `own_id`, URLs http(s), keys P-256.
pub fn load(path: &Path, own_id: &str) -> Result<Vec<Peer>, PeersError> {
    let error = |reason: String| PeersError::File {
        path: path.display().to_string(),
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| error(e.to_string()))?;
    let file: PeersFile = serde_json::from_str(&text).map_err(|e| {
        error(format!(
            "{e}; expected {{\"peers\": [{{\"id\", \"url\", \"verifying_key\"}}]}}"
        ))
    })?;
    parse(file.peers, own_id).map_err(error)
}

fn parse(entries: Vec<PeerEntry>, own_id: &str) -> Result<Vec<Peer>, String> {
    let mut peers: Vec<Peer> = Vec::new();
    for entry in entries {
        if !crate::keys::valid_id(&entry.id) {
            return Err(format!("peer id {:?} is not a key service id", entry.id));
        }
        if entry.id == own_id {
            return Err(format!(
                "peer {:?} is this key service itself; list only the others",
                entry.id
            ));
        }
        if peers.iter().any(|p| p.id == entry.id) {
            return Err(format!("peer {:?} is listed twice", entry.id));
        }
        if !(entry.url.starts_with("https://") || entry.url.starts_with("http://")) {
            return Err(format!(
                "peer {:?}: url {:?} must start with https:// (or http:// on a private network)",
                entry.id, entry.url
            ));
        }
        let verifying_key = confed_attestation::exchange::decode_verifying_key(
            &entry.verifying_key,
        )
        .ok_or_else(|| {
            format!(
                "peer {:?}: verifying_key is not a base64url SEC1 P-256 point (as GET /v1/keys publishes it)",
                entry.id
            )
        })?;
        peers.push(Peer {
            id: entry.id,
            url: entry.url.trim_end_matches('/').to_string(),
            verifying_key,
        });
    }
    Ok(peers)
}

/// Whether `head` is `keyservice_id`'s head signed with `key` (an empty head carries no
/// signature and proves nothing, but claims nothing either).
pub fn head_is_signed_by(head: &SignedHead, keyservice_id: &str, key: &VerifyingKey) -> bool {
    if head.keyservice_id != keyservice_id {
        return false;
    }
    if head.records == 0 {
        return head.hash == crate::audit::GENESIS_HASH && head.signature.is_none();
    }
    let Some(signature) = &head.signature else {
        return false;
    };
    let text = crate::audit::head_text(keyservice_id, head.records - 1, &head.hash);
    confed_attestation::release::verify_text(key, &text, signature)
}

/// What `GET /v1/audit/witnessed/{id}` and `POST /v1/audit/witness` answer: the latest head of
/// `keyservice_id` the answering service witnessed, or `null`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Witnessed {
    pub keyservice_id: String,
    pub witnessed: Option<SignedHead>,
}

/// `GET /v1/audit/records?from=K`: records `K..` of the answering service's log (at most
/// `MAX_RECORDS_PER_ANSWER`).
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Records {
    pub records: Vec<Record>,
}

/// `GET /v1/audit/acknowledgement?records=R&hash=H`: the `loss_acknowledged` record naming
/// that head, or `null`.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Acknowledgement {
    pub record: Option<Record>,
}

/// Records per answer of `GET /v1/audit/records`.
pub const MAX_RECORDS_PER_ANSWER: usize = 256;
/// Records a witness fetches to verify one advance at most (a peer further ahead is verified
/// over several pulls: each advances the kept head as far as it verified).
pub const MAX_RECORDS_PER_ADVANCE: usize = 16 * MAX_RECORDS_PER_ANSWER;

impl Peers {
    pub fn new(list: Vec<Peer>, quorum: Option<usize>) -> Self {
        let quorum = quorum.unwrap_or_else(|| default_quorum(list.len()));
        Self {
            quorum: quorum.min(list.len()),
            list,
            client: confed_protocol::http::client(PEER_TIMEOUT),
        }
    }

    /// `GET {peer}/v1/audit/head`: the peer's own latest signed head.
    pub async fn head(&self, peer: &Peer) -> Result<SignedHead, String> {
        let url = format!("{}/v1/audit/head", peer.url);
        self.json(self.client.get(&url), &url, MAX_ANSWER_BYTES)
            .await
    }

    /// `GET {peer}/v1/audit/witnessed/{of}`: the latest head of key service `of` the peer
    /// witnessed (`None`: it witnessed none). Anything but that answer is an error.
    pub async fn witnessed(&self, peer: &Peer, of: &str) -> Result<Option<SignedHead>, String> {
        let url = format!("{}/v1/audit/witnessed/{of}", peer.url);
        let answer: Witnessed = self
            .json(self.client.get(&url), &url, MAX_ANSWER_BYTES)
            .await?;
        Self::about(answer, of, &url)
    }

    /// `POST {peer}/v1/audit/witness` with this service's head; the peer answers with the
    /// latest head of this service it witnessed (the one sent, or one it kept before).
    pub async fn push(&self, peer: &Peer, head: &SignedHead) -> Result<Option<SignedHead>, String> {
        let url = format!("{}/v1/audit/witness", peer.url);
        let answer: Witnessed = self
            .json(self.client.post(&url).json(head), &url, MAX_ANSWER_BYTES)
            .await?;
        Self::about(answer, &head.keyservice_id, &url)
    }

    fn about(answer: Witnessed, of: &str, url: &str) -> Result<Option<SignedHead>, String> {
        if answer.keyservice_id != of
            || answer
                .witnessed
                .as_ref()
                .is_some_and(|h| h.keyservice_id != of)
        {
            return Err(format!("{url} answered about another key service"));
        }
        Ok(answer.witnessed)
    }

    /// `GET {peer}/v1/audit/records?from=K`.
    pub async fn records(&self, peer: &Peer, from: u64) -> Result<Vec<Record>, String> {
        let url = format!("{}/v1/audit/records?from={from}", peer.url);
        let answer: Records = self
            .json(self.client.get(&url), &url, MAX_RECORDS_BYTES)
            .await?;
        Ok(answer.records)
    }

    /// `GET {peer}/v1/audit/acknowledgement?records=R&hash=H`.
    pub async fn acknowledgement(
        &self,
        peer: &Peer,
        lost: &crate::audit::LostHead,
    ) -> Result<Option<Record>, String> {
        let url = format!(
            "{}/v1/audit/acknowledgement?records={}&hash={}",
            peer.url, lost.records, lost.hash
        );
        let answer: Acknowledgement = self
            .json(self.client.get(&url), &url, MAX_ANSWER_BYTES)
            .await?;
        Ok(answer.record)
    }

    /// Sends `request`; a 200 answer of at most `cap` bytes, as `T`.
    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
        url: &str,
        cap: usize,
    ) -> Result<T, String> {
        let mut response = request.send().await.map_err(|e| format!("{url}: {e}"))?;
        let status = response.status();
        if status != reqwest::StatusCode::OK {
            return Err(format!("{url} answered {status}"));
        }
        if response.content_length().is_some_and(|n| n > cap as u64) {
            return Err(format!("{url} answered more than {cap} bytes"));
        }
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| format!("{url}: {e}"))? {
            if bytes.len() + chunk.len() > cap {
                return Err(format!("{url} answered more than {cap} bytes"));
            }
            bytes.extend_from_slice(&chunk);
        }
        serde_json::from_slice(&bytes).map_err(|e| format!("{url}: not the expected answer: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str, url: &str) -> PeerEntry {
        let key = confed_attestation::exchange::generate_signing_key();
        PeerEntry {
            id: id.into(),
            url: url.into(),
            verifying_key: confed_attestation::exchange::encode_verifying_key(key.verifying_key()),
        }
    }

    #[test]
    fn the_start_quorum_is_half_the_peers_rounded_up() {
        assert_eq!([0, 1, 2, 3, 4, 6].map(default_quorum), [0, 1, 1, 2, 2, 3]);
        assert_eq!(
            Peers::new(vec![], Some(3)).quorum,
            0,
            "never above the peers"
        );
    }

    #[test]
    fn a_peers_file_naming_itself_twice_a_peer_or_a_bad_url_is_refused() {
        let own = parse(vec![entry("ks1", "http://a")], "ks1").unwrap_err();
        assert!(own.contains("itself"), "{own}");
        let twice = parse(
            vec![entry("ks2", "http://a"), entry("ks2", "http://b")],
            "ks1",
        );
        assert!(twice.unwrap_err().contains("twice"));
        let url = parse(vec![entry("ks2", "ks2:8443")], "ks1").unwrap_err();
        assert!(url.contains("https://"), "{url}");
        let mut bad_key = entry("ks2", "http://a");
        bad_key.verifying_key = "AAAA".into();
        assert!(parse(vec![bad_key], "ks1").unwrap_err().contains("P-256"));
        let ok = parse(vec![entry("ks2", "https://ks2.example/")], "ks1").unwrap();
        assert_eq!(ok[0].url, "https://ks2.example");
    }
}
