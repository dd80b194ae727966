//! The device side of confed, as a library other Rust programs (and phones) can use: check in,
//! honour retry windows, verify the task key (T trusted signatures), download the model with
//! caching, check the task policy against the device's limits, seal the update with HPKE, upload
//! with retries (idempotent), report. The wire formats are `confed-protocol`'s.

#![forbid(unsafe_code)]

pub mod analytics;
pub mod app_attest;
pub mod client;
pub mod masked;
pub mod schedule;
pub mod state;
pub mod tokens;
pub mod update;

pub use analytics::{AnalyticsError, Records};
pub use app_attest::{AppAttestError, AppAttestService, AppleAppAttest};
pub use client::{
    AcceptedPolicy, Checkin, DeviceClient, DeviceError, Model, VerifiedKeys, load_trust,
};
pub use confed_protocol::device::{AssignmentResponse, ReportOutcome, RetryResponse, RetryWindow};
pub use confed_protocol::hpke::PublicKey;
pub use confed_protocol::policy::{EVALUATION_TENSOR, Evaluation, HEALTH_TENSOR};
pub use confed_protocol::trust::{TrustConfig, TrustedEntry, TrustedIssuer};
pub use schedule::{Cancel, DueUpdate, Schedule, SendTimes, Trained};
pub use state::{DeviceState, FileStore, StateError, StateStore};
pub use tokens::{
    AndroidKeyAttestation, AssignmentToken, Attestation, DevAttestation, TokenSource,
};
pub use update::{ModelShapeError, TrainingProblem, UpdateShape, WellFormedUpdate};
