//! What only the SQLite engine runs: the device store on the writer's raw rusqlite handle.

pub(super) mod device;
