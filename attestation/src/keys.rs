//! Where a verifier gets the keys that sign attestation tokens: a fixed key set (a JWKS file), or
//! the issuer's OpenID discovery document, cached and refetched when a token names an unknown `kid`
//! (Google rotates its signing keys) or the set is an hour old.
//!
//! Fetches are coalesced (one in flight; the others wait for it and use its result) and
//! attempted at most once per `MIN_REFETCH_SECONDS`, failed attempts included: tokens naming
//! unknown key ids cannot make the service hammer the issuer. A set that could not be refreshed
//! is served for at most `MAX_STALE_SECONDS` after it was fetched, then refused, so an issuer's
//! revoked key does not stay trusted forever behind a blocked network.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use crate::jwk::{Jwk, Jwks};

pub const CACHE_TTL_SECONDS: i64 = 3600;
pub const MIN_REFETCH_SECONDS: i64 = 60;
pub const MAX_STALE_SECONDS: i64 = 24 * 3600;

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
    /// The last fetch attempt, successful or not.
    attempted_at: Option<i64>,
    last_error: Option<String>,
}

/// What the cache can answer without fetching.
enum Lookup {
    /// A usable answer (the key, or that the fresh set has no such kid).
    Answer(Option<Jwk>),
    /// Fetch first.
    Due,
    /// Nothing usable and no fetch allowed yet.
    Refused(String),
}

impl Cache {
    fn lookup(&self, kid: &str, now: i64) -> Lookup {
        let age = self.fetched_at.map(|t| now.saturating_sub(t));
        let found = self.jwks.as_ref().and_then(|j| j.get(kid).cloned());
        let may_attempt = self
            .attempted_at
            .is_none_or(|t| now.saturating_sub(t) >= MIN_REFETCH_SECONDS);
        let stale = age.is_none_or(|a| a >= CACHE_TTL_SECONDS);
        if may_attempt && (found.is_none() || stale) {
            return Lookup::Due;
        }
        match age {
            Some(age) if age < MAX_STALE_SECONDS => Lookup::Answer(found),
            Some(_) => Lookup::Refused(format!(
                "the issuer's keys could not be refreshed for {MAX_STALE_SECONDS} s ({}); retrying at most once a minute",
                self.last_error.as_deref().unwrap_or("no error recorded")
            )),
            None => Lookup::Refused(format!(
                "the issuer's keys could not be loaded ({}); retrying at most once a minute",
                self.last_error
                    .as_deref()
                    .unwrap_or("no attempt finished yet")
            )),
        }
    }
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
        /// Held while a fetch is in flight, so concurrent misses make one fetch.
        fetching: Arc<tokio::sync::Mutex<()>>,
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
            fetching: Arc::default(),
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
                fetching,
            } => {
                let lookup = |cache: &Mutex<Cache>| {
                    cache
                        .lock()
                        .map(|c| c.lookup(kid, now))
                        .map_err(|_| "key cache poisoned".to_string())
                };
                match lookup(cache)? {
                    Lookup::Answer(key) => return Ok(key),
                    Lookup::Refused(why) => return Err(why),
                    Lookup::Due => {}
                }
                let _one_fetch = fetching.lock().await;
                // Another request may have fetched (or failed to) while this one waited.
                match lookup(cache)? {
                    Lookup::Answer(key) => return Ok(key),
                    Lookup::Refused(why) => return Err(why),
                    Lookup::Due => {}
                }
                cache
                    .lock()
                    .map_err(|_| "key cache poisoned".to_string())?
                    .attempted_at = Some(now);
                let fetched = fetcher.fetch(url).await;
                let mut cache = cache.lock().map_err(|_| "key cache poisoned".to_string())?;
                match fetched {
                    Ok(jwks) => {
                        let key = jwks.get(kid).cloned();
                        cache.jwks = Some(jwks);
                        cache.fetched_at = Some(now);
                        cache.last_error = None;
                        Ok(key)
                    }
                    Err(e) => {
                        let error = format!("cannot fetch the issuer's keys from {url}: {e}");
                        cache.last_error = Some(error.clone());
                        // A failed refresh keeps serving a cached key, up to the maximum age.
                        match cache.lookup(kid, now) {
                            Lookup::Answer(Some(key)) => Ok(Some(key)),
                            _ => Err(error),
                        }
                    }
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

    #[derive(Debug)]
    struct SlowFailingFetcher {
        calls: AtomicUsize,
        fail: std::sync::atomic::AtomicBool,
        gate: tokio::sync::Notify,
        jwks: Jwks,
    }

    impl JwksFetcher for SlowFailingFetcher {
        fn fetch<'a>(&'a self, _url: &'a str) -> FetchFuture<'a> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            Box::pin(async move {
                self.gate.notified().await;
                if self.fail.load(Ordering::SeqCst) {
                    Err("issuer unreachable".to_string())
                } else {
                    Ok(self.jwks.clone())
                }
            })
        }
    }

    /// 30 tokens with unknown key ids while the issuer was unreachable once made 30 outbound
    /// fetches: concurrent misses now share one fetch, and a failure waits a minute like a
    /// success does.
    #[tokio::test]
    async fn unknown_kid_floods_make_one_fetch_and_failures_are_rate_limited() {
        let (_, counting) = source();
        let fetcher = Arc::new(SlowFailingFetcher {
            calls: AtomicUsize::new(0),
            fail: std::sync::atomic::AtomicBool::new(true),
            gate: tokio::sync::Notify::new(),
            jwks: counting.jwks.clone(),
        });
        let source = KeySource::discovery("https://issuer.example/d", fetcher.clone());
        let waiting: Vec<_> = (0..30)
            .map(|i| {
                let source = source.clone();
                tokio::spawn(async move { source.key(Some(&format!("unknown-{i}")), 1000).await })
            })
            .collect();
        while fetcher.calls.load(Ordering::SeqCst) == 0 {
            tokio::task::yield_now().await;
        }
        fetcher.gate.notify_one(); // a permit, even if the fetch is not waiting yet
        for task in waiting {
            assert!(task.await.unwrap().is_err(), "the issuer is unreachable");
        }
        assert_eq!(
            fetcher.calls.load(Ordering::SeqCst),
            1,
            "one fetch for 30 misses"
        );
        for _ in 0..10 {
            assert!(source.key(Some("k1"), 1030).await.is_err());
        }
        assert_eq!(
            fetcher.calls.load(Ordering::SeqCst),
            1,
            "a failure waits a minute too"
        );
    }

    /// A failed refresh once served a stale key set forever: now at most a day.
    #[tokio::test]
    async fn a_stale_key_set_is_served_a_day_at_most() {
        let (_, counting) = source();
        let fetcher = Arc::new(SlowFailingFetcher {
            calls: AtomicUsize::new(0),
            fail: std::sync::atomic::AtomicBool::new(false),
            gate: tokio::sync::Notify::new(),
            jwks: counting.jwks.clone(),
        });
        let source = KeySource::discovery("https://issuer.example/d", fetcher.clone());
        let fetch = |now: i64| {
            let (source, fetcher) = (source.clone(), fetcher.clone());
            async move {
                let task = tokio::spawn(async move { source.key(Some("k1"), now).await });
                while !task.is_finished() {
                    fetcher.gate.notify_waiters();
                    tokio::task::yield_now().await;
                }
                task.await.unwrap()
            }
        };
        assert!(fetch(0).await.unwrap().is_some());
        fetcher.fail.store(true, Ordering::SeqCst);
        let hour = CACHE_TTL_SECONDS;
        assert!(
            fetch(hour).await.unwrap().is_some(),
            "stale but young enough"
        );
        assert!(fetch(MAX_STALE_SECONDS - 1).await.unwrap().is_some());
        let refused = fetch(MAX_STALE_SECONDS).await.unwrap_err();
        assert!(refused.contains("issuer unreachable"), "{refused}");
        fetcher.fail.store(false, Ordering::SeqCst);
        assert!(
            fetch(MAX_STALE_SECONDS + 60).await.unwrap().is_some(),
            "recovers"
        );
    }
}
