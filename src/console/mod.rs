//! The partner console: server-rendered HTML pages at `/console` over the same task database as
//! the partner API, for partners who would rather look than curl. A browser signs in with the
//! tenant's API token once; it gets a session cookie (the token is never stored in the browser),
//! and every form carries a CSRF token. No JavaScript: running rounds refresh with a meta tag.
//!
//! The console is served by the untrusted front end, like the API: what it shows is the
//! server's word. The release checks it shows are re-run here against the key services this
//! server knows; a partner who does not trust the operator runs `confed verify release` with
//! their own trust file (docs/console.md says so on the page).

mod analytics;
mod charts;
mod error;
mod evaluations;
mod layout;
mod new_task;
mod populations;
mod session;
mod task_page;
mod tasks;

use axum::Router;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{HeaderValue, Method, header};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::{get, post};

use crate::app::AppState;
pub use error::ConsoleError;

/// The stylesheet, compiled in (no build step, no second origin).
const STYLESHEET: &str = include_str!("console.css");

/// The console's routes; `web::router` merges them.
pub fn router(state: AppState) -> Router<AppState> {
    let limits = &state.limits;
    let model_upload = Router::new()
        .route("/console/tasks/{id}/model", post(task_page::upload_model))
        .layer(DefaultBodyLimit::max(limits.model_bytes));
    Router::new()
        .route("/console", get(|| async { Redirect::to("/console/tasks") }))
        .route(
            "/console/sign-in",
            get(session::sign_in_page).post(session::sign_in),
        )
        .route("/console/sign-out", post(session::sign_out))
        .route("/console/tasks", get(tasks::list).post(new_task::create))
        .route("/console/tasks/new", get(new_task::new_form))
        .route("/console/tasks/{id}", get(task_page::show))
        .route("/console/tasks/{id}/cancel", post(task_page::cancel))
        .route(
            "/console/tasks/{id}/evaluations",
            post(evaluations::request),
        )
        .route(
            "/console/tasks/{id}/models/{version}",
            get(task_page::download_model),
        )
        .route("/console/populations", get(populations::show))
        .route("/console/console.css", get(stylesheet))
        .layer(DefaultBodyLimit::max(limits.json_body_bytes))
        .merge(model_upload)
        .layer(from_fn_with_state(state, same_origin_posts))
        .layer(from_fn(security_headers))
}

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "max-age=300"),
        ],
        STYLESHEET,
    )
        .into_response()
}

/// Refuses a POST another site made the browser send. A POST must name its origin: `Origin`
/// equal to this server's (the scheme it speaks, and the host the request was sent to: the
/// URI's authority under HTTP/2, else `Host`), and `Sec-Fetch-Site`, when sent, `same-origin`.
/// Browsers send `Origin` with every form post; a request with neither header is refused too.
/// The CSRF token is the main defence; this one also covers the sign-in form, which has no
/// session to derive a token from (login CSRF), and same-site pages on other ports, to which
/// `SameSite` alone would send the cookie.
async fn same_origin_posts(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == Method::POST {
        let scheme = if state.console.secure_cookies {
            "https"
        } else {
            "http"
        };
        if let Err(refused) = check_same_origin(request.uri(), request.headers(), scheme) {
            return refused.into_response();
        }
    }
    next.run(request).await
}

fn check_same_origin(
    uri: &axum::http::Uri,
    headers: &axum::http::HeaderMap,
    scheme: &str,
) -> Result<(), ConsoleError> {
    let cross = || {
        ConsoleError::Forbidden(
            "this form was sent from another site (or without saying where from); open the \
             console and submit it from there"
                .into(),
        )
    };
    if let Some(site) = headers.get("sec-fetch-site")
        && site.as_bytes() != b"same-origin"
    {
        return Err(cross());
    }
    let origin = headers
        .get(header::ORIGIN)
        .and_then(|o| o.to_str().ok())
        .ok_or_else(cross)?;
    let host = uri
        .authority()
        .map(|a| a.as_str())
        .or_else(|| headers.get(header::HOST).and_then(|h| h.to_str().ok()))
        .ok_or_else(cross)?;
    let origin_host = origin
        .strip_prefix(scheme)
        .and_then(|rest| rest.strip_prefix("://"))
        .ok_or_else(cross)?;
    if origin_host.eq_ignore_ascii_case(host) {
        Ok(())
    } else {
        Err(cross())
    }
}

/// Headers every console answer carries: a strict content security policy (no scripts at all,
/// styles only from this server, forms only to it, no framing), no sniffing, no referrer to
/// other sites, and no caching of pages that show a tenant's data.
async fn security_headers(request: Request, next: Next) -> Response {
    let is_stylesheet = request.uri().path() == "/console/console.css";
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'",
        ),
    );
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    headers.insert(
        header::REFERRER_POLICY,
        // `same-origin`, not `no-referrer`: under `no-referrer` a browser sends `Origin: null`
        // with the console's own form posts, which the same-origin check must then refuse.
        HeaderValue::from_static("same-origin"),
    );
    if !is_stylesheet {
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderMap;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_static(value));
        }
        map
    }

    #[test]
    fn same_origin_check_refuses_other_sites_and_allows_this_one() {
        let plain: axum::http::Uri = "/console/sign-in".parse().unwrap();
        let h2: axum::http::Uri = "https://c.example/console/sign-in".parse().unwrap();
        let ok = [
            (
                &plain,
                "http",
                headers(&[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                ]),
            ),
            (
                &plain,
                "http",
                headers(&[
                    ("host", "127.0.0.1:8080"),
                    ("origin", "http://127.0.0.1:8080"),
                    ("sec-fetch-site", "same-origin"),
                ]),
            ),
            (
                &plain,
                "https",
                headers(&[("host", "c.example"), ("origin", "https://C.example")]),
            ),
            // HTTP/2 carries the host in the URI's authority, not in a Host header.
            (
                &h2,
                "https",
                headers(&[
                    ("origin", "https://c.example"),
                    ("sec-fetch-site", "same-origin"),
                ]),
            ),
        ];
        for (uri, scheme, h) in &ok {
            assert!(check_same_origin(uri, h, scheme).is_ok(), "{uri} {h:?}");
        }
        let refused = [
            (
                &plain,
                "https",
                headers(&[("host", "c.example"), ("origin", "https://evil.example")]),
            ),
            (
                &plain,
                "https",
                headers(&[("host", "c.example"), ("origin", "null")]),
            ),
            (
                &plain,
                "https",
                headers(&[("host", "c.example"), ("origin", "http://c.example")]),
            ),
            (
                &plain,
                "https",
                headers(&[
                    ("host", "c.example"),
                    ("origin", "https://c.example"),
                    ("sec-fetch-site", "same-site"),
                ]),
            ),
            (
                &plain,
                "https",
                headers(&[
                    ("host", "c.example"),
                    ("origin", "https://c.example"),
                    ("sec-fetch-site", "none"),
                ]),
            ),
            (&plain, "https", headers(&[("host", "c.example")])),
            (&plain, "https", headers(&[("origin", "https://c.example")])),
            (&h2, "https", headers(&[("origin", "https://evil.example")])),
        ];
        for (uri, scheme, h) in &refused {
            assert!(check_same_origin(uri, h, scheme).is_err(), "{uri} {h:?}");
        }
    }
}
