//! Where a verifier gets the keys that sign attestation tokens: a fixed key set (a JWKS file), or
//! the issuer's OpenID discovery document, cached and refetched when a token names an unknown `kid`
//! (Google rotates its signing keys), at most once per `MIN_REFETCH_SECONDS`.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use crate::jwk::{Jwk, Jwks};

pub const CACHE_TTL_SECONDS: i64 = 3600;
pub const MIN_REFETCH_SECONDS: i64 = 60;

pub type FetchFuture<'a> = Pin<Box<dyn Future<Output = Result<Jwks, String>> + Send + 'a>>;

/// Fetches the key set named by a discovery document (`jwks_uri`). Implemented over HTTP by the
/// key service; tests use fakes.
pub trait JwksFetcher: Send + Sync + std::fmt::Debug {
    fn fetch<'a>(&'a self, discovery_url: &'a str) -> FetchFuture<'a>;
}

#[derive(Debug, Default)]
struct Cache {
    jwks: Option<Jwks>,
    fetched_at: Option<i64>,
}

/// The policy's token-signing keys.
#[derive(Debug, Clone)]
pub struct KeySource(Source);

#[derive(Debug, Clone)]
enum Source {
    Static(Jwks),
    Discovery {
        url: String,
        fetcher: Arc<dyn JwksFetcher>,
        cache: Arc<Mutex<Cache>>,
    },
}

impl KeySource {
    /// A fixed key set (a JWKS file, the dev attester's key, a test root).
    pub fn fixed(jwks: Jwks) -> Self {
        Self(Source::Static(jwks))
    }

    pub fn discovery(url: impl Into<String>, fetcher: Arc<dyn JwksFetcher>) -> Self {
        Self(Source::Discovery {
            url: url.into(),
            fetcher,
            cache: Arc::default(),
        })
    }

    /// The key for `kid`, fetching or refreshing the set when needed. `now` is Unix seconds.
    pub async fn key(&self, kid: Option<&str>, now: i64) -> Result<Option<Jwk>, String> {
        let Some(kid) = kid else { return Ok(None) };
        match &self.0 {
            Source::Static(jwks) => Ok(jwks.get(kid).cloned()),
            Source::Discovery {
                url,
                fetcher,
                cache,
            } => {
                let (cached, due) = {
                    let cache = cache.lock().map_err(|_| "key cache poisoned".to_string())?;
                    let found = cache.jwks.as_ref().and_then(|j| j.get(kid).cloned());
                    let age = cache.fetched_at.map(|t| now - t);
                    let stale = age.is_none_or(|a| a >= CACHE_TTL_SECONDS);
                    let may_refetch = age.is_none_or(|a| a >= MIN_REFETCH_SECONDS);
                    (found.clone(), (found.is_none() && may_refetch) || stale)
                };
                if !due {
                    return Ok(cached);
                }
                match fetcher.fetch(url).await {
                    Ok(jwks) => {
                        let key = jwks.get(kid).cloned();
                        let mut cache =
                            cache.lock().map_err(|_| "key cache poisoned".to_string())?;
                        cache.jwks = Some(jwks);
                        cache.fetched_at = Some(now);
                        Ok(key)
                    }
                    // A failed refresh keeps serving a cached key rather than refusing everyone.
                    Err(_) if cached.is_some() => Ok(cached),
                    Err(e) => Err(format!("cannot fetch the issuer's keys from {url}: {e}")),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    #[derive(Debug)]
    struct CountingFetcher {
        calls: AtomicUsize,
        jwks: Jwks,
    }

    impl JwksFetcher for CountingFetcher {
        fn fetch<'a>(&'a self, _url: &'a str) -> FetchFuture<'a> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let jwks = self.jwks.clone();
            Box::pin(async move { Ok(jwks) })
        }
    }

    fn source() -> (KeySource, Arc<CountingFetcher>) {
        let key = crate::dev::generate_signing_key();
        let text =
            serde_json::json!({"keys": [crate::jwk::p256_public_jwk("k1", key.verifying_key())]});
        let fetcher = Arc::new(CountingFetcher {
            calls: AtomicUsize::new(0),
            jwks: Jwks::from_json(&text.to_string()).unwrap(),
        });
        (
            KeySource::discovery(
                "https://issuer.example/.well-known/openid-configuration",
                fetcher.clone(),
            ),
            fetcher,
        )
    }

    #[tokio::test]
    async fn caches_known_keys_and_refetches_unknown_kid_at_most_once_a_minute() {
        let (source, fetcher) = source();
        assert!(source.key(Some("k1"), 1000).await.unwrap().is_some());
        assert!(source.key(Some("k1"), 1001).await.unwrap().is_some());
        assert_eq!(
            fetcher.calls.load(Ordering::SeqCst),
            1,
            "known kid served from cache"
        );
        assert!(source.key(Some("k9"), 1002).await.unwrap().is_none());
        assert_eq!(
            fetcher.calls.load(Ordering::SeqCst),
            1,
            "refetch is rate limited"
        );
        assert!(
            source
                .key(Some("k9"), 1000 + MIN_REFETCH_SECONDS)
                .await
                .unwrap()
                .is_none()
        );
        assert_eq!(
            fetcher.calls.load(Ordering::SeqCst),
            2,
            "unknown kid refetches after a minute"
        );
        source
            .key(Some("k1"), 1000 + MIN_REFETCH_SECONDS + CACHE_TTL_SECONDS)
            .await
            .unwrap();
        assert_eq!(
            fetcher.calls.load(Ordering::SeqCst),
            3,
            "stale cache refreshes"
        );
    }

    #[tokio::test]
    async fn token_without_kid_has_no_key() {
        let (source, fetcher) = source();
        assert!(source.key(None, 0).await.unwrap().is_none());
        assert_eq!(fetcher.calls.load(Ordering::SeqCst), 0);
    }
}
