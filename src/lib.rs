//! confed: the untrusted front ends of a confidential-computing federated-learning server (task
//! management for partners, the scheduler, the task database, the blob store) and its CLI.
//! Nothing here ever sees a plaintext update, a key share or an un-noised sum.
//!
//! The device library is `confed-device` (re-exported as `confed::device` for the tools), the
//! wire formats are `confed-protocol`; `tools` holds the simulator, local training and the demo.

pub mod aggregation;
pub mod api;
pub mod auth;
pub mod blob;
pub mod checkin;
pub mod clock;
pub mod console;
pub mod db;
pub mod embedded;
pub mod evaluation;
pub mod keys;
pub mod registry;
pub mod release_check;
pub mod retention;
pub mod scheduler;
pub mod scheduling;
pub mod server;
pub mod states;
pub mod task_spec;
pub mod tools;
pub mod uploads;
pub mod verify;

pub use confed_device as device;
pub use confed_keyservice as keyservice;
