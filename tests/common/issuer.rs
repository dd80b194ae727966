//! A dev token issuer in the test process (dev attester, the RFC 9578 test vectors' key), for the
//! tests of tasks that require device tokens.

use std::sync::Arc;

use confed_issuer::Issuer;
use confed_issuer::attester::dev::DevAttester;
use confed_issuer::limiter::Limiter;
use confed_protocol::privacy_pass::issuance::TokenSigner;

pub const ISSUER: &str = "issuer.test";

/// The issuer's signing key: the second RFC 9578 test vector's.
pub fn signer() -> TokenSigner {
    let cases: Vec<std::collections::BTreeMap<String, String>> = serde_json::from_str(
        include_str!("../../protocol/testdata/privacy_pass_type2_vectors.json"),
    )
    .unwrap();
    TokenSigner::from_pem(&cases[1]["skS_pem"]).unwrap()
}

/// The issuer on a local port, keeping its state in `state`; returns its URL.
pub async fn issuer(state: &std::path::Path, clock: Arc<confed::clock::ManualClock>) -> String {
    let issuer = Issuer::new(
        ISSUER.into(),
        signer(),
        Box::new(DevAttester),
        Limiter::open(state, 2, 86_400).unwrap(),
        86_400,
        clock,
    )
    .unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = confed_issuer::routes::router(Arc::new(issuer));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}
