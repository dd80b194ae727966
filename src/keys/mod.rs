//! Task encryption keys as the front ends see them: the key services' signed key sets
//! (`directory`). The ceremony and the share files are the key service's
//! (`confed_keyservice::keys`, re-exported here).

pub mod directory;

pub use confed_keyservice::keys::*;
