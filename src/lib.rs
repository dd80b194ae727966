//! confed: the untrusted front ends of a confidential-computing federated-learning server (task
//! management for partners, the scheduler, the task database, the blob store) and its CLI.
//! Nothing here ever sees a plaintext update, a key share or an un-noised sum.

pub mod aggregation;
pub mod api;
pub mod auth;
pub mod blob;
pub mod clock;
pub mod db;
pub mod demo;
pub mod device;
pub mod embedded;
pub mod keys;
pub mod keyservice;
pub mod registry;
pub mod release_check;
pub mod retention;
pub mod scheduler;
pub mod server;
pub mod states;
pub mod task_spec;
pub mod verify;
