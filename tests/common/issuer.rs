//! A dev token issuer in the test process (dev attester, the RFC 9578 test vectors' key), for the
//! tests of tasks that require device tokens.

use std::sync::Arc;

use confed_issuer::Issuer;
use confed_issuer::attester::dev::DevAttester;
use confed_issuer::limiter::Limiter;
use confed_protocol::privacy_pass::issuance::TokenSigner;

pub(crate) const ISSUER: &str = "issuer.test";

/// The issuer's signing key: the second RFC 9578 test vector's.
pub(crate) fn signer() -> TokenSigner {
    let cases: Vec<std::collections::BTreeMap<String, String>> = serde_json::from_str(
        include_str!("../../protocol/testdata/privacy_pass_type2_vectors.json"),
    )
    .unwrap();
    TokenSigner::from_pem(&cases[1]["skS_pem"]).unwrap()
}

/// The issuer on a local port, keeping its state in `state`; returns its URL.
pub(crate) async fn issuer(
    state: &std::path::Path,
    clock: Arc<confed::clock::ManualClock>,
) -> String {
    issuer_holding(state, clock, vec![signer()], 2).await
}

/// An issuer holding `keys` (the first first, as during a rotation), `tokens_per_window` tokens
/// per device and day, on a local port; returns its URL.
pub(crate) async fn issuer_holding(
    state: &std::path::Path,
    clock: Arc<confed::clock::ManualClock>,
    keys: Vec<TokenSigner>,
    tokens_per_window: u32,
) -> String {
    let mut keys = keys.into_iter();
    let mut issuer = Issuer::new(
        ISSUER.into(),
        keys.next().expect("a key"),
        Box::new(DevAttester),
        Limiter::open(state, tokens_per_window, 86_400).unwrap(),
        86_400,
        clock,
    )
    .unwrap();
    for key in keys {
        issuer = issuer.with_key(key).unwrap();
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = confed_issuer::routes::router(Arc::new(issuer));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}
