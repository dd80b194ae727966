//! Console sign-in: the tenant's API token, posted once, is exchanged for a session. The browser
//! keeps only a random 256-bit session secret in an HttpOnly, SameSite=Strict cookie (Secure and
//! `__Host-` prefixed when the server speaks TLS); the database keeps only its SHA-256. Every form
//! carries a CSRF token derived from the secret (HMAC-SHA256), which a page of another site can
//! neither read nor compute. Sessions end after `session_ttl_millis` or at sign-out.

use axum::extract::{FromRequestParts, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use confed_protocol::hex::sha256_hex;
use maud::html;
use serde::Deserialize;
use subtle::ConstantTimeEq;
use zeroize::{Zeroize, Zeroizing};

use super::error::{ConsoleError, ConsoleForm};
use super::layout;
use crate::api::error::ApiError;
use crate::app::{AppState, ConsoleSettings};
use crate::db::TenantRecord;

impl ConsoleSettings {
    fn cookie_name(&self) -> &'static str {
        if self.secure_cookies {
            "__Host-confed_session"
        } else {
            "confed_session"
        }
    }

    fn cookie(&self, value: &str, max_age_seconds: i64) -> String {
        format!(
            "{}={value}; Path=/; Max-Age={max_age_seconds}; HttpOnly; SameSite=Strict{}",
            self.cookie_name(),
            if self.secure_cookies { "; Secure" } else { "" }
        )
    }
}

/// Length of a session secret: 32 random bytes, base64url without padding.
const SECRET_CHARS: usize = 43;

/// The session cookie's value, if the request carries a well-formed one.
fn session_secret(headers: &HeaderMap, name: &str) -> Option<Zeroizing<String>> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
        .filter(|value| {
            value.len() == SECRET_CHARS
                && value
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        })
        .map(|value| Zeroizing::new(value.to_string()))
}

/// What the database stores for a session: never the secret itself.
fn session_digest(secret: &str) -> String {
    sha256_hex(secret.as_bytes())
}

/// The CSRF token of a session: HMAC-SHA256 keyed by the session secret.
fn csrf_token(secret: &str) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret.as_bytes());
    URL_SAFE_NO_PAD.encode(ring::hmac::sign(&key, b"confed console csrf v1").as_ref())
}

/// A signed-in browser: its tenant and the CSRF token its forms must carry.
pub(super) struct Session {
    pub tenant: TenantRecord,
    pub csrf: String,
    id_sha256: String,
}

impl Session {
    /// Refuses a form whose CSRF token is not this session's (compared in constant time).
    pub(super) fn check_csrf(&self, presented: &str) -> Result<(), ConsoleError> {
        if bool::from(presented.as_bytes().ct_eq(self.csrf.as_bytes())) {
            Ok(())
        } else {
            Err(ConsoleError::Forbidden(
                "the form's security token is missing or stale; reload the page and submit again"
                    .into(),
            ))
        }
    }
}

impl FromRequestParts<AppState> for Session {
    type Rejection = ConsoleError;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Self, ConsoleError> {
        Self::from_headers(&parts.headers, state).await
    }
}

impl Session {
    async fn from_headers(headers: &HeaderMap, state: &AppState) -> Result<Self, ConsoleError> {
        let secret =
            session_secret(headers, state.console.cookie_name()).ok_or(ConsoleError::SignedOut)?;
        let id_sha256 = session_digest(&secret);
        let tenant = state
            .db
            .console_session_tenant(&id_sha256)
            .await?
            .ok_or(ConsoleError::SignedOut)?;
        Ok(Self {
            tenant,
            csrf: csrf_token(&secret),
            id_sha256,
        })
    }
}

fn sign_in_form(problem: Option<&str>) -> maud::Markup {
    html! {
        h1 { "Sign in" }
        p { "Paste your tenant's API token (" code { "cft_..." } "). It is checked once and not kept by your browser: you get a session of one hour." }
        @if let Some(problem) = problem {
            p.problem role="alert" id="sign-in-problem" { (problem) }
        }
        form method="post" action="/console/sign-in" {
            label for="token" { "API token" }
            input #token type="password" name="token" required autocomplete="off"
                spellcheck="false" aria-describedby=[problem.map(|_| "sign-in-problem")];
            button type="submit" { "Sign in" }
        }
    }
}

pub(super) async fn sign_in_page(State(state): State<AppState>, headers: HeaderMap) -> Response {
    if Session::from_headers(&headers, &state).await.is_ok() {
        return Redirect::to("/console/tasks").into_response();
    }
    Html(layout::page("Sign in", None, None, sign_in_form(None)).into_string()).into_response()
}

#[derive(Deserialize)]
pub(super) struct SignInForm {
    token: String,
}

impl Drop for SignInForm {
    fn drop(&mut self) {
        self.token.zeroize();
    }
}

pub(super) async fn sign_in(
    State(state): State<AppState>,
    ConsoleForm(form): ConsoleForm<SignInForm>,
) -> Result<Response, ConsoleError> {
    let Some(tenant) = state.db.tenant_for_token(form.token.trim()).await? else {
        let page = layout::page(
            "Sign in",
            None,
            None,
            sign_in_form(Some(
                "That token is not valid. Check that you pasted all of it, or ask the operator for a tenant token.",
            )),
        );
        return Ok((StatusCode::UNAUTHORIZED, Html(page.into_string())).into_response());
    };
    let secret =
        Zeroizing::new(URL_SAFE_NO_PAD.encode(
            crate::auth::random_bytes::<32>().map_err(|e| ApiError::Internal(e.to_string()))?,
        ));
    let ttl = state.console.session_ttl_millis;
    state
        .db
        .create_console_session(&session_digest(&secret), &tenant.id, ttl)
        .await?;
    tracing::info!(tenant = %tenant.name, "console sign-in");
    let cookie = state.console.cookie(&secret, ttl / 1000);
    Ok(redirect_with_cookie("/console/tasks", &cookie))
}

#[derive(Deserialize)]
pub(super) struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

pub(super) async fn sign_out(
    State(state): State<AppState>,
    session: Session,
    ConsoleForm(form): ConsoleForm<CsrfForm>,
) -> Result<Response, ConsoleError> {
    session.check_csrf(&form.csrf)?;
    state.db.delete_console_session(&session.id_sha256).await?;
    Ok(redirect_with_cookie(
        "/console/sign-in",
        &state.console.cookie("", 0),
    ))
}

fn redirect_with_cookie(location: &str, cookie: &str) -> Response {
    let mut response = Redirect::to(location).into_response();
    match HeaderValue::from_str(cookie) {
        Ok(value) => {
            response.headers_mut().insert(header::SET_COOKIE, value);
            response
        }
        Err(e) => {
            ConsoleError::Api(ApiError::Internal(format!("cookie header: {e}"))).into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookie_is_http_only_strict_and_secure_off_loopback() {
        let plain = ConsoleSettings::default().cookie("v", 3600);
        assert_eq!(
            plain,
            "confed_session=v; Path=/; Max-Age=3600; HttpOnly; SameSite=Strict"
        );
        let tls = ConsoleSettings {
            secure_cookies: true,
            ..Default::default()
        }
        .cookie("v", 3600);
        assert!(tls.starts_with("__Host-confed_session=v; Path=/;"));
        assert!(tls.ends_with("; HttpOnly; SameSite=Strict; Secure"));
    }

    #[test]
    fn only_a_well_formed_secret_of_the_named_cookie_is_read() {
        let secret = "A".repeat(SECRET_CHARS);
        let mut headers = HeaderMap::new();
        headers.insert(
            header::COOKIE,
            HeaderValue::from_str(&format!("other=x; confed_session={secret}")).unwrap(),
        );
        assert_eq!(
            session_secret(&headers, "confed_session")
                .as_deref()
                .map(String::as_str),
            Some(secret.as_str())
        );
        assert!(session_secret(&headers, "__Host-confed_session").is_none());
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("confed_session=short"),
        );
        assert!(session_secret(&headers, "confed_session").is_none());
    }

    #[test]
    fn csrf_tokens_differ_per_session_and_are_checked() {
        let a = csrf_token(&"a".repeat(SECRET_CHARS));
        let b = csrf_token(&"b".repeat(SECRET_CHARS));
        assert_ne!(a, b);
        let session = Session {
            tenant: TenantRecord {
                id: "t".into(),
                name: "n".into(),
                max_active_tasks: 1,
                max_report_goal: 1,
                max_device_hours: 1,
                created_at: 0,
            },
            csrf: a.clone(),
            id_sha256: String::new(),
        };
        assert!(session.check_csrf(&a).is_ok());
        assert!(session.check_csrf(&b).is_err());
        assert!(session.check_csrf("").is_err());
    }
}
