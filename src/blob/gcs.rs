//! Google Cloud Storage behind the blob-store interface, through Google's official crate.
//!
//! - Writes are create-only (`ifGenerationMatch=0`): GCS itself refuses a second object under a
//!   name, so a release or model is never overwritten, and the server needs only
//!   `storage.objects.create` and `storage.objects.get` — no delete, no overwrite, no listing.
//! - Devices upload contributions straight to GCS through V4 signed URLs (`direct_upload`) whose
//!   signed headers carry the same create-only precondition; the server sees only the object's
//!   size and digest when the device reports (`stat`, one metadata GET, never a listing).
//! - Credentials come from the environment (Application Default Credentials: the metadata server
//!   on GCP). URLs are signed with the same identity (IAM `signBlob`), or locally with a service
//!   account key file when the operator gives one.
//!
//! Emulator mode: an endpoint of plain `http://` on a loopback address is a GCS emulator
//! (fake-gcs-server in tests and `deploy/local`), and gets anonymous credentials rather than the
//! environment's. Any other endpoint must be https.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use google_cloud_auth::credentials::{CacheableResource, Credentials, anonymous};
use google_cloud_auth::signer::Signer;
use google_cloud_storage::builder::storage::SignedUrlBuilder;
use google_cloud_storage::client::Storage;

use super::cache::ReadCache;
use super::{BlobError, BlobFuture, BlobKey, BlobStore, DirectUpload, ObjectInfo, PutOutcome};

const GOOGLE_ENDPOINT: &str = "https://storage.googleapis.com";

/// Where objects go: `gs://bucket/prefix`, and the endpoint when it is not Google's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GcsConfig {
    pub bucket: String,
    /// Empty, or ends with `/`.
    pub prefix: String,
    /// `None` for Google; a loopback `http://` URL for an emulator.
    pub endpoint: Option<String>,
    /// A service account key (JSON) to sign upload URLs locally; else the ambient identity signs
    /// through IAM `signBlob`.
    pub signing_key_file: Option<PathBuf>,
}

impl GcsConfig {
    /// Parses `gs://bucket[/prefix]`.
    pub fn parse(url: &str) -> Result<Self, BlobError> {
        let setup = |why: &str| BlobError::Setup(format!("{url:?}: {why}"));
        let rest = url
            .strip_prefix("gs://")
            .ok_or_else(|| setup("a blob store URL must look like gs://bucket/prefix"))?;
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let bucket_ok = (3..=63).contains(&bucket.len())
            && bucket
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"-_.".contains(&b));
        if !bucket_ok {
            return Err(setup(
                "the bucket name must be 3-63 of a-z 0-9 - _ . (GCS bucket naming rules)",
            ));
        }
        let prefix = prefix.trim_end_matches('/');
        if !prefix.is_empty() {
            BlobKey::new(prefix).map_err(|_| {
                setup("the prefix must be /-separated segments of A-Z a-z 0-9 . _ -")
            })?;
        }
        Ok(Self {
            bucket: bucket.to_string(),
            prefix: if prefix.is_empty() {
                String::new()
            } else {
                format!("{prefix}/")
            },
            endpoint: None,
            signing_key_file: None,
        })
    }

    /// Whether the endpoint is a local emulator (plain HTTP on loopback).
    pub fn is_emulator(&self) -> bool {
        self.endpoint.as_deref().is_some_and(is_loopback_http)
    }
}

fn is_loopback_http(endpoint: &str) -> bool {
    let Some(rest) = endpoint.strip_prefix("http://") else {
        return false;
    };
    let host = rest.split('/').next().unwrap_or("");
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    matches!(host, "127.0.0.1" | "localhost" | "[::1]")
}

/// The shared client; `store(sub)` gives a store for one part of the bucket.
#[derive(Clone)]
pub struct Gcs {
    client: Storage,
    http: reqwest::Client,
    credentials: Credentials,
    signer: Arc<tokio::sync::OnceCell<Signer>>,
    config: Arc<GcsConfig>,
}

impl std::fmt::Debug for Gcs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gcs(gs://{}/{})", self.config.bucket, self.config.prefix)
    }
}

impl Gcs {
    pub async fn connect(config: GcsConfig) -> Result<Self, BlobError> {
        // The crate is built without its own TLS backend: ring is the process's one provider.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let setup = |e: &dyn std::fmt::Display| BlobError::Setup(format!("GCS client: {e}"));
        if let Some(endpoint) = &config.endpoint
            && !is_loopback_http(endpoint)
            && !endpoint.starts_with("https://")
        {
            return Err(BlobError::Setup(format!(
                "GCS endpoint {endpoint:?}: use https://, or http:// only on a loopback address \
                 (an emulator)"
            )));
        }
        let credentials = if config.is_emulator() {
            tracing::warn!(
                "blobs on a GCS EMULATOR at {} with anonymous credentials — for tests and \
                 deploy/local only; it checks no signatures.",
                config.endpoint.as_deref().unwrap_or_default()
            );
            anonymous::Builder::new().build()
        } else {
            google_cloud_auth::credentials::Builder::default()
                .build()
                .map_err(|e| setup(&e))?
        };
        let mut builder = Storage::builder().with_credentials(credentials.clone());
        if let Some(endpoint) = &config.endpoint {
            builder = builder.with_endpoint(endpoint.clone());
        }
        let client = builder.build().await.map_err(|e| setup(&e))?;
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| setup(&e))?;
        Ok(Self {
            client,
            http,
            credentials,
            signer: Arc::default(),
            config: Arc::new(config),
        })
    }

    /// A store for the objects under `<prefix><part>/`.
    pub fn store(&self, part: &str) -> GcsBlobStore {
        GcsBlobStore {
            gcs: self.clone(),
            prefix: format!("{}{part}/", self.config.prefix),
            cache: None,
        }
    }

    /// `store`, keeping small objects it reads in memory: for models, which every device that
    /// checks in downloads (objects are create-only, so a copy is never stale).
    pub fn cached_store(&self, part: &str) -> GcsBlobStore {
        GcsBlobStore {
            cache: Some(Arc::default()),
            ..self.store(part)
        }
    }

    fn bucket_resource(&self) -> String {
        format!("projects/_/buckets/{}", self.config.bucket)
    }

    fn endpoint(&self) -> &str {
        self.config.endpoint.as_deref().unwrap_or(GOOGLE_ENDPOINT)
    }

    async fn signer(&self) -> Result<&Signer, BlobError> {
        self.signer
            .get_or_try_init(|| async {
                let signer = match &self.config.signing_key_file {
                    Some(path) => {
                        let text = tokio::fs::read_to_string(path).await.map_err(|e| {
                            BlobError::Setup(format!("signing key {}: {e}", path.display()))
                        })?;
                        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
                            BlobError::Setup(format!(
                                "signing key {}: not a service account key (JSON): {e}",
                                path.display()
                            ))
                        })?;
                        google_cloud_auth::credentials::service_account::Builder::new(json)
                            .build_signer()
                    }
                    None => google_cloud_auth::credentials::Builder::default().build_signer(),
                };
                signer.map_err(|e| BlobError::Setup(format!("URL signer: {e}")))
            })
            .await
    }
}

/// One part of the bucket (`blobs/` or `contributions/`).
#[derive(Clone)]
pub struct GcsBlobStore {
    gcs: Gcs,
    prefix: String,
    cache: Option<Arc<std::sync::Mutex<ReadCache>>>,
}

impl std::fmt::Debug for GcsBlobStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GcsBlobStore({:?}, {})", self.gcs, self.prefix)
    }
}

impl GcsBlobStore {
    fn object(&self, key: &BlobKey) -> String {
        format!("{}{}", self.prefix, key.as_str())
    }

    fn remote(&self, key: &BlobKey, e: impl std::fmt::Display) -> BlobError {
        BlobError::Remote {
            key: key.as_str().to_string(),
            message: e.to_string(),
        }
    }

    async fn read(&self, key: &BlobKey) -> Result<Option<Vec<u8>>, BlobError> {
        let response = self
            .gcs
            .client
            .read_object(self.gcs.bucket_resource(), self.object(key))
            .send()
            .await;
        let mut response = match response {
            Ok(r) => r,
            Err(e) if e.http_status_code() == Some(404) => return Ok(None),
            Err(e) => return Err(self.remote(key, e)),
        };
        let mut bytes = Vec::new();
        while let Some(chunk) = response.next().await {
            bytes.extend_from_slice(&chunk.map_err(|e| self.remote(key, e))?);
        }
        Ok(Some(bytes))
    }

    /// Existing bytes under `key` decide: the same bytes are `AlreadyPresent`, others a conflict.
    async fn compare_existing(&self, key: &BlobKey, bytes: &[u8]) -> Result<PutOutcome, BlobError> {
        match self.read(key).await? {
            Some(existing) if existing == bytes => Ok(PutOutcome::AlreadyPresent),
            Some(_) => Err(BlobError::Conflict(key.as_str().to_string())),
            None => Err(self.remote(
                key,
                "GCS refused the create-only write (412) but has no such object",
            )),
        }
    }

    async fn put_inner(&self, key: &BlobKey, bytes: &[u8]) -> Result<PutOutcome, BlobError> {
        let write = self
            .gcs
            .client
            .write_object(
                self.gcs.bucket_resource(),
                self.object(key),
                bytes::Bytes::copy_from_slice(bytes),
            )
            .set_if_generation_match(0);
        match write.send_buffered().await {
            Ok(_) => Ok(PutOutcome::Created),
            Err(e) if e.http_status_code() == Some(412) => self.compare_existing(key, bytes).await,
            Err(e) => Err(self.remote(key, e)),
        }
    }

    /// `put_inner` of a file's whole content, read from the file: the crate buffers a
    /// single-shot upload (below its 16 MiB resumable threshold) and sends larger ones in
    /// pieces of `FILE_UPLOAD_BUFFER`.
    async fn put_file_inner(
        &self,
        key: &BlobKey,
        file: &std::fs::File,
    ) -> Result<PutOutcome, BlobError> {
        use tokio::io::AsyncSeekExt;
        let io = |source| BlobError::Io {
            key: key.as_str().to_string(),
            source,
        };
        let size = file.metadata().map_err(io)?.len();
        let mut source = tokio::fs::File::from_std(file.try_clone().map_err(io)?);
        source.rewind().await.map_err(io)?;
        let write = self
            .gcs
            .client
            .write_object(self.gcs.bucket_resource(), self.object(key), source)
            .set_if_generation_match(0)
            .with_resumable_upload_buffer_size(FILE_UPLOAD_BUFFER);
        match write.send_buffered().await {
            Ok(_) => Ok(PutOutcome::Created),
            // The object exists. Model keys name their content's SHA-256, so the same size
            // under the same key is the same upload again (a retry after the database commit
            // failed); comparing the bytes would read both into memory.
            Err(e) if e.http_status_code() == Some(412) => match self.stat_inner(key).await? {
                Some(existing) if existing.size == size => Ok(PutOutcome::AlreadyPresent),
                Some(_) => Err(BlobError::Conflict(key.as_str().to_string())),
                None => Err(self.remote(
                    key,
                    "GCS refused the create-only write (412) but has no such object",
                )),
            },
            Err(e) => Err(self.remote(key, e)),
        }
    }

    async fn stat_inner(&self, key: &BlobKey) -> Result<Option<ObjectInfo>, BlobError> {
        // objects.get (metadata) over the JSON API: the crate routes metadata through its gRPC
        // control client, which emulators do not serve; this is one small GET either way.
        let url = format!(
            "{}/storage/v1/b/{}/o/{}?fields=size,md5Hash,generation",
            self.gcs.endpoint(),
            self.gcs.config.bucket,
            percent_encode_all(&self.object(key))
        );
        let mut request = self.gcs.http.get(url);
        match self
            .gcs
            .credentials
            .headers(http::Extensions::new())
            .await
            .map_err(|e| self.remote(key, e))?
        {
            CacheableResource::New { data, .. } => request = request.headers(data),
            CacheableResource::NotModified => {
                return Err(self.remote(key, "credentials returned no headers"));
            }
        }
        let response = request.send().await.map_err(|e| self.remote(key, e))?;
        if response.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !response.status().is_success() {
            return Err(self.remote(key, format!("metadata GET: HTTP {}", response.status())));
        }
        #[derive(serde::Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Metadata {
            size: String,
            #[serde(default)]
            md5_hash: Option<String>,
        }
        let metadata: Metadata = response.json().await.map_err(|e| self.remote(key, e))?;
        let size = metadata
            .size
            .parse()
            .map_err(|_| self.remote(key, format!("size {:?} is not a number", metadata.size)))?;
        let digest = match metadata.md5_hash.map(|b64| STANDARD.decode(b64)) {
            Some(Ok(md5)) => format!("md5:{}", confed_protocol::hex::encode(md5)),
            _ => return Err(self.remote(key, "the object has no MD5 hash (composite?)")),
        };
        Ok(Some(ObjectInfo { size, digest }))
    }

    async fn direct_upload_inner(
        &self,
        key: &BlobKey,
        valid_for: Duration,
        max_bytes: u64,
    ) -> Result<Option<DirectUpload>, BlobError> {
        let signer = self.gcs.signer().await?;
        let headers = BTreeMap::from([
            ("content-type".to_string(), "application/cbor".to_string()),
            // Create-only: the device cannot replace its contribution once it is there.
            ("x-goog-if-generation-match".to_string(), "0".to_string()),
            // Signed, so GCS refuses a body outside it: a device cannot store an object of any
            // size at the operator's cost until the lifecycle rule deletes it.
            (
                "x-goog-content-length-range".to_string(),
                format!("1,{}", max_bytes.max(1)),
            ),
        ]);
        let mut builder =
            SignedUrlBuilder::for_object(self.gcs.bucket_resource(), self.object(key))
                .with_method(google_cloud_storage::http::Method::PUT)
                .with_expiration(valid_for.clamp(Duration::from_secs(1), MAX_SIGNED_URL));
        for (name, value) in &headers {
            builder = builder.with_header(name.clone(), value.clone());
        }
        if let Some(endpoint) = &self.gcs.config.endpoint {
            builder = builder.with_endpoint(endpoint.clone());
        }
        let url = builder
            .sign_with(signer)
            .await
            .map_err(|e| self.remote(key, format!("signing the upload URL: {e}")))?;
        Ok(Some(DirectUpload { url, headers }))
    }
}

/// V4 signed URLs live at most seven days.
const MAX_SIGNED_URL: Duration = Duration::from_secs(7 * 24 * 3600);

/// Object names go into a URL path segment whole: every byte but unreserved ones is encoded.
fn percent_encode_all(name: &str) -> String {
    name.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// What a file upload holds in memory at once (one piece of a resumable upload).
const FILE_UPLOAD_BUFFER: usize = 8 << 20;

impl BlobStore for GcsBlobStore {
    fn put<'a>(&'a self, key: &'a BlobKey, bytes: &'a [u8]) -> BlobFuture<'a, PutOutcome> {
        Box::pin(self.put_inner(key, bytes))
    }

    fn put_file<'a>(
        &'a self,
        key: &'a BlobKey,
        file: &'a std::fs::File,
    ) -> BlobFuture<'a, PutOutcome> {
        Box::pin(self.put_file_inner(key, file))
    }

    fn get<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(async move {
            let cached = self.cache.as_ref().and_then(|c| c.lock().ok()?.get(key));
            if let Some(bytes) = cached {
                return Ok(bytes);
            }
            let bytes = self
                .read(key)
                .await?
                .ok_or_else(|| BlobError::NotFound(key.as_str().to_string()))?;
            if let Some(Ok(mut cache)) = self.cache.as_ref().map(|c| c.lock()) {
                cache.insert(key, &bytes);
            }
            Ok(bytes)
        })
    }

    /// Past the read cache: what the enclave authenticates itself (sealed partitions, read
    /// once by their round's merge) would only push the models out of it.
    fn get_sealed<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(async move {
            self.read(key)
                .await?
                .ok_or_else(|| BlobError::NotFound(key.as_str().to_string()))
        })
    }

    fn get_range<'a>(&'a self, key: &'a BlobKey, offset: u64, len: u64) -> BlobFuture<'a, Vec<u8>> {
        Box::pin(async move {
            let response = self
                .gcs
                .client
                .read_object(self.gcs.bucket_resource(), self.object(key))
                .set_read_range(google_cloud_storage::model_ext::ReadRange::segment(
                    offset, len,
                ))
                .send()
                .await;
            let mut response = match response {
                Ok(r) => r,
                Err(e) if e.http_status_code() == Some(404) => {
                    return Err(BlobError::NotFound(key.as_str().to_string()));
                }
                // A range that starts at or past the end: no bytes, as the default reads it.
                Err(e) if e.http_status_code() == Some(416) => return Ok(Vec::new()),
                Err(e) => return Err(self.remote(key, e)),
            };
            let mut bytes = Vec::new();
            while let Some(chunk) = response.next().await {
                bytes.extend_from_slice(&chunk.map_err(|e| self.remote(key, e))?);
                if bytes.len() as u64 > len {
                    return Err(self.remote(key, "the store sent more than the range asked"));
                }
            }
            Ok(bytes)
        })
    }

    fn stat<'a>(&'a self, key: &'a BlobKey) -> BlobFuture<'a, Option<ObjectInfo>> {
        Box::pin(self.stat_inner(key))
    }

    fn accepts_direct_uploads(&self) -> bool {
        true
    }

    fn direct_upload<'a>(
        &'a self,
        key: &'a BlobKey,
        valid_for: Duration,
        max_bytes: u64,
    ) -> BlobFuture<'a, Option<DirectUpload>> {
        Box::pin(self.direct_upload_inner(key, valid_for, max_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_name_a_bucket_and_an_optional_prefix() {
        let c = GcsConfig::parse("gs://confed-prod/eu/one").unwrap();
        assert_eq!(
            (c.bucket.as_str(), c.prefix.as_str()),
            ("confed-prod", "eu/one/")
        );
        let c = GcsConfig::parse("gs://confed-prod").unwrap();
        assert_eq!(c.prefix, "");
        assert_eq!(GcsConfig::parse("gs://confed-prod/").unwrap().prefix, "");
        for bad in [
            "s3://x/y",
            "gs://",
            "gs://UPPER",
            "gs://ok-bucket/../x",
            "gs://a",
        ] {
            assert!(GcsConfig::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn only_plain_http_on_loopback_is_an_emulator() {
        let with = |endpoint: &str| GcsConfig {
            endpoint: Some(endpoint.into()),
            ..GcsConfig::parse("gs://bucket").unwrap()
        };
        assert!(with("http://127.0.0.1:4443").is_emulator());
        assert!(with("http://localhost:4443/").is_emulator());
        assert!(!with("https://127.0.0.1:4443").is_emulator());
        assert!(!with("http://storage.googleapis.com").is_emulator());
        assert!(!with("http://127.0.0.1.evil.example:80").is_emulator());
        assert!(!GcsConfig::parse("gs://bucket").unwrap().is_emulator());
    }

    #[test]
    fn object_names_are_encoded_whole() {
        assert_eq!(percent_encode_all("a/b c.cbor"), "a%2Fb%20c.cbor");
    }
}
