//! Responses every route can give, declared on every operation of the OpenAPI document: the
//! handlers declare what is theirs; the layers around them (body limits and extractors, the
//! request timeout, storage and internal failures) can answer any route, and a client written
//! from the document should expect them.

use utoipa::openapi::path::{Operation, PathItem};
use utoipa::openapi::{ContentBuilder, OpenApi, Ref, RefOr, ResponseBuilder};

fn problem(description: &str) -> RefOr<utoipa::openapi::Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content(
                crate::api::error::PROBLEM_JSON,
                ContentBuilder::new()
                    .schema(Some(Ref::from_schema_name("Problem")))
                    .build(),
            )
            .build(),
    )
}

fn operations(item: &mut PathItem) -> impl Iterator<Item = (bool, &mut Operation)> {
    [
        (false, item.get.as_mut()),
        (true, item.put.as_mut()),
        (true, item.post.as_mut()),
        (true, item.delete.as_mut()),
        (true, item.patch.as_mut()),
    ]
    .into_iter()
    .filter_map(|(writes, op)| op.map(|op| (writes, op)))
}

/// Adds, where a route does not declare them itself: 400 (bad parameters or body), 408 (the
/// request timeout), 413 and 415 (routes with a body), 500, 503 (a store unavailable) and, on
/// routes that write, 507 (storage full).
pub fn declare_common_responses(openapi: &mut OpenApi) {
    for item in openapi.paths.paths.values_mut() {
        let path_params = item.parameters.as_ref().is_some_and(|p| !p.is_empty());
        for (writes, operation) in operations(item) {
            let has_body = operation.request_body.is_some();
            let has_params =
                path_params || operation.parameters.as_ref().is_some_and(|p| !p.is_empty());
            let mut add = |status: &str, description: &str| {
                operation
                    .responses
                    .responses
                    .entry(status.to_string())
                    .or_insert_with(|| problem(description));
            };
            if has_body || has_params {
                add("400", "A parameter or the body is malformed");
            }
            if has_body {
                add("413", "The body is larger than this route accepts");
                add(
                    "415",
                    "The body's media type is not the one this route takes",
                );
            }
            add(
                "408",
                "The request took longer than the server's request timeout",
            );
            add("500", "The server failed; the detail names an incident id");
            add(
                "503",
                "A store is unavailable; retry after `Retry-After` seconds",
            );
            if writes {
                add(
                    "507",
                    "The server's storage is full; nothing was stored; retry after `Retry-After` seconds",
                );
            }
        }
    }
}
