//! Task encryption keys as the front ends see them: the key services' signed key sets
//! (`directory`) and the key states they name. With the `embedded` feature, the ceremony and the
//! share files too (the key service's, `confed_keyservice::keys`, re-exported here for the
//! embedded key services and `confed keys`).

pub mod directory;

#[cfg(feature = "embedded")]
pub use confed_keyservice::keys::*;
pub use confed_protocol::keys::KeyState;
