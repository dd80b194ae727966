//! The worker API's paths (docs/protocol.md, "Worker API"), defined once: the front end routes
//! these templates (axum's `{id}` and `{*key}` syntax) and the enclave's HTTP client fills them
//! in, so the two sides cannot spell a path differently.

/// Where every worker API path starts.
pub const PREFIX: &str = "/internal/v1";

/// One route of the worker API.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Lease,
    Renew,
    Fail,
    BltState,
    Release,
    OptimizerState,
    Model,
    Partition,
    /// A blob of the store (model versions, committed averages, states, sealed partitions).
    Blob,
    /// A stored contribution envelope.
    Contribution,
    /// Several stored contribution envelopes in one exchange (`batch`).
    Contributions,
}

impl Route {
    pub const ALL: [Route; 11] = [
        Route::Lease,
        Route::Renew,
        Route::Fail,
        Route::BltState,
        Route::Release,
        Route::OptimizerState,
        Route::Model,
        Route::Partition,
        Route::Blob,
        Route::Contribution,
        Route::Contributions,
    ];

    /// The route's path template as the server declares it: `{id}` is a job id, `{*key}` a blob
    /// key (slashes included).
    pub fn template(self) -> &'static str {
        match self {
            Route::Lease => "/internal/v1/jobs/lease",
            Route::Renew => "/internal/v1/jobs/{id}/renew",
            Route::Fail => "/internal/v1/jobs/{id}/fail",
            Route::BltState => "/internal/v1/jobs/{id}/blt-state",
            Route::Release => "/internal/v1/jobs/{id}/release",
            Route::OptimizerState => "/internal/v1/jobs/{id}/optimizer-state",
            Route::Model => "/internal/v1/jobs/{id}/model",
            Route::Partition => "/internal/v1/jobs/{id}/partition",
            Route::Blob => "/internal/v1/blobs/{*key}",
            Route::Contribution => "/internal/v1/contributions/{*key}",
            Route::Contributions => "/internal/v1/contributions",
        }
    }

    /// The HTTP method the route answers.
    pub fn method(self) -> &'static str {
        match self {
            Route::Lease | Route::Renew | Route::Fail | Route::Contributions => "POST",
            Route::BltState
            | Route::Release
            | Route::OptimizerState
            | Route::Model
            | Route::Partition => "PUT",
            Route::Blob | Route::Contribution => "GET",
        }
    }

    /// The route's path for `id`: a job id, or a blob key for `Blob` and `Contribution`
    /// (ignored by `Lease` and `Contributions`). Job ids and blob keys need no escaping: both are checked to
    /// `A-Z a-z 0-9 . _ -` (and `/` between a key's segments) by whoever made them.
    pub fn path(self, id: &str) -> String {
        self.template().replace("{id}", id).replace("{*key}", id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_route_lives_under_the_prefix_and_fills_its_one_placeholder() {
        for route in Route::ALL {
            let template = route.template();
            assert!(template.starts_with(PREFIX), "{route:?}");
            let path = route.path("r1.a2");
            assert!(!path.contains('{'), "{route:?}: {path}");
            if !matches!(route, Route::Lease | Route::Contributions) {
                assert!(path.contains("/r1.a2"), "{route:?}: {path}");
            }
        }
        assert_eq!(Route::Renew.path("j"), "/internal/v1/jobs/j/renew");
        assert_eq!(
            Route::Blob.path("tenants/t/tasks/x/models/1-ab.safetensors"),
            "/internal/v1/blobs/tenants/t/tasks/x/models/1-ab.safetensors"
        );
    }

    #[test]
    fn no_two_routes_share_a_method_and_template() {
        let mut seen = std::collections::BTreeSet::new();
        for route in Route::ALL {
            assert!(seen.insert((route.method(), route.template())), "{route:?}");
        }
    }
}
