//! A model version's bytes as an HTTP response, with its SHA-256 as a strong ETag and 304 for a
//! matching `If-None-Match`: shared by the partner API (`models::get_model`) and the console's
//! download, which differ only in their caching.

use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use crate::app::AppState;
use crate::blob::BlobKey;

/// Whether an `If-None-Match` value names the entity tag `"<tag>"`: `*`, or any listed tag,
/// weak (`W/"..."`) or strong, that equals it (RFC 9110 13.1.2 compares weakly).
fn if_none_match_names(value: &str, tag: &str) -> bool {
    value.split(',').map(str::trim).any(|listed| {
        listed == "*"
            || listed
                .strip_prefix("W/")
                .unwrap_or(listed)
                .strip_prefix('"')
                .and_then(|t| t.strip_suffix('"'))
                == Some(tag)
    })
}

/// A model version's bytes with a strong ETag (its SHA-256), or 304 when `If-None-Match` matches.
pub async fn model_response(
    state: &AppState,
    model: &crate::db::ModelRecord,
    headers: &HeaderMap,
    cache_control: &'static str,
) -> Result<Response, ApiError> {
    let etag = HeaderValue::from_str(&format!("\"{}\"", model.sha256_hex))
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    let cache = HeaderValue::from_static(cache_control);
    let matches = headers
        .get_all(header::IF_NONE_MATCH)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| if_none_match_names(v, &model.sha256_hex));
    if matches {
        return Ok((
            StatusCode::NOT_MODIFIED,
            [(header::ETAG, etag), (header::CACHE_CONTROL, cache)],
        )
            .into_response());
    }
    let bytes = state
        .blobs
        .get(&BlobKey::new(model.blob_key.clone())?)
        .await?;
    Ok((
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/octet-stream"),
            ),
            (header::ETAG, etag),
            (header::CACHE_CONTROL, cache),
        ],
        bytes,
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::if_none_match_names;

    #[test]
    fn if_none_match_compares_weakly_and_takes_lists_and_any() {
        let tag = "ab12";
        for matching in [
            "\"ab12\"",
            "W/\"ab12\"",
            "\"x\", W/\"ab12\"",
            " \"x\" ,\"ab12\" ",
            "*",
        ] {
            assert!(if_none_match_names(matching, tag), "{matching}");
        }
        for other in ["\"ab1\"", "ab12", "W/ab12", "\"ab12", "w/\"ab12\"", ""] {
            assert!(!if_none_match_names(other, tag), "{other}");
        }
    }
}
