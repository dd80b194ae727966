//! What every HTTP handler shares (`AppState`), the limits applied to every request, and the
//! services handlers call: `api/` and `console/` parse a request, call a service through this
//! state and map its answer; the services (`checkin`, `tasks`, `uploads`, ...) know nothing of
//! HTTP. `web::router` puts the routes together.

use std::sync::Arc;
use std::time::Duration;

use crate::auth::AdminToken;
use crate::blob::BlobStore;
use crate::clock::Millis;
use crate::db::Db;
use crate::keys::directory::KeyDirectory;
use crate::registry::DeviceRegistry;

/// Limits applied to every request.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest JSON request body.
    pub json_body_bytes: usize,
    /// Largest model upload.
    pub model_bytes: usize,
    /// Longest time a request may take, body upload included.
    pub request_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            json_body_bytes: 256 * 1024,
            model_bytes: 512 * 1024 * 1024,
            request_timeout: Duration::from_secs(120),
        }
    }
}

/// What every handler shares.
#[derive(Debug, Clone)]
pub struct AppState {
    pub db: Db,
    /// Models and aggregates.
    pub blobs: Arc<dyn BlobStore>,
    /// Device contributions (many small write-once objects).
    pub contributions: Arc<dyn BlobStore>,
    /// `None` turns the admin API off.
    pub admin: Option<AdminToken>,
    pub limits: Limits,
    /// The key services' signed key sets, for assignments.
    pub keys: KeyDirectory,
    /// Recent check-ins (soft state).
    pub registry: Arc<DeviceRegistry>,
    /// `None` turns the worker API (`/internal/v1`) off.
    pub worker_token: Option<AdminToken>,
    /// The partner console's cookie settings.
    pub console: ConsoleSettings,
    /// Which fitting task a checking-in device serves first (`confed serve --scheduling`).
    pub scheduling: crate::scheduling::SchedulingPolicy,
    /// How large rounds are cut into partitions for several enclave workers.
    pub partitioning: crate::aggregation::partitions::PartitionPolicy,
    /// Each task's device-token requirement, for the upload check (`uploads/device_tokens.rs`).
    pub device_auth: crate::uploads::device_tokens::DeviceAuthCache,
    /// Hands masked rounds' uploads to the key services ahead of their sums
    /// (`uploads/mask_prepare.rs`); `Default` prepares nothing.
    pub mask_preparer: crate::uploads::mask_prepare::MaskPreparer,
}

impl AppState {
    /// The time of this request: the task database's clock, the one time of the process.
    pub fn now(&self) -> Millis {
        self.db.now()
    }

    /// The check-in service over this state's database, keys, contribution store and registry.
    pub fn checkin(&self) -> crate::checkin::Checkin<'_> {
        crate::checkin::Checkin {
            db: &self.db,
            scheduling: self.scheduling,
            keys: &self.keys,
            contributions: self.contributions.as_ref(),
            registry: &self.registry,
        }
    }

    /// The evaluation service over this state's database.
    pub fn evaluations(&self) -> crate::evaluation::Evaluations<'_> {
        crate::evaluation::Evaluations { db: &self.db }
    }

    /// The task service over this state's database, model store and check-in registry.
    pub fn tasks(&self) -> crate::tasks::Tasks<'_> {
        crate::tasks::Tasks {
            db: &self.db,
            blobs: self.blobs.as_ref(),
            registry: &self.registry,
            keys: &self.keys,
        }
    }

    /// The upload service over this state's database, keys and contribution store.
    pub fn uploads(&self) -> crate::uploads::Uploads<'_> {
        crate::uploads::Uploads {
            db: &self.db,
            keys: &self.keys,
            contributions: self.contributions.as_ref(),
            preparer: &self.mask_preparer,
        }
    }
}

/// The console's cookie and session settings (`console/session.rs` writes the cookie).
#[derive(Debug, Clone, Copy)]
pub struct ConsoleSettings {
    /// Mark the cookie `Secure` (and name it `__Host-...`): on whenever the server speaks TLS.
    /// Off only for plain HTTP, which the server allows on loopback alone.
    pub secure_cookies: bool,
    /// How long a sign-in lasts, from sign-in (not sliding).
    pub session_ttl_millis: i64,
}

impl Default for ConsoleSettings {
    fn default() -> Self {
        Self {
            secure_cookies: false,
            session_ttl_millis: 60 * 60 * 1000,
        }
    }
}
