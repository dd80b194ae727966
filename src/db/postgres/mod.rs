//! What only the PostgreSQL engine runs: the device store as single-statement CTEs and row locks,
//! for many replicas at once.

pub(super) mod batch;
pub(super) mod device;
pub(super) mod notify;
pub(super) mod readers;
pub(super) mod sets;
