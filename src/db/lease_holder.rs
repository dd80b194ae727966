//! Who holds a job's or a partition's lease, and when a worker may take a lease back before it
//! expires (docs/architecture.md, "Aggregation: jobs, workers, releases").
//!
//! A lease's holder is `<worker>~<arrived><token>`. `arrived` is when the lease request that
//! wrote it arrived (Unix ms, 16 decimal digits) and `token` 12 random hex digits. Every write
//! under a lease names its holder, and every lease writes a new one (a fencing token): whatever
//! an earlier holder still sends is refused as a lost lease.
//!
//! A worker runs one job at a time and asks for a lease only when it holds none, so a lease still
//! held under its name is one it lost track of (a restart, a failure it could not record, a lease
//! answer that never reached it). It takes such a lease back at once:
//! - one held by another incarnation of its name (`name/other` when it is `name/this`): its
//!   process before a restart;
//! - one held under its own id and written by a lease request that arrived no later than this
//!   one. A request that outlived its client (a long poll the worker gave up on, still being
//!   served here or on another replica) is older than the worker's retry, so it cannot take back
//!   the lease the retry got.

/// Separates a worker id from the rest of its lease's holder; no worker id contains it
/// (`confed::api::workers` checks the ids it accepts).
pub const HOLDER_SEPARATOR: char = '~';

/// One lease request: the holder it writes if it gets a lease, and which leases it may take back.
#[derive(Debug, Clone)]
pub(crate) struct LeaseAsk {
    pub holder: String,
    /// `name/` of a worker `name/incarnation`, else empty: other incarnations' leases.
    pub other_incarnations: String,
    /// `<worker>~`: the leases this worker id holds.
    pub own: String,
    /// When this request arrived, as the holder spells it (16 decimal digits).
    pub arrived: String,
}

impl LeaseAsk {
    pub fn new(worker: &str, arrived_ms: i64) -> Self {
        let own = format!("{worker}{HOLDER_SEPARATOR}");
        let arrived = format!("{:016}", arrived_ms.max(0));
        let token = uuid::Uuid::new_v4().simple().to_string();
        Self {
            holder: format!("{own}{arrived}{}", &token[..12]),
            other_incarnations: worker
                .split_once('/')
                .map(|(name, _)| format!("{name}/"))
                .unwrap_or_default(),
            own,
            arrived,
        }
    }

    /// The SQL condition under which this request takes back the lease of a row whose columns
    /// are prefixed `p` (e.g. `p.`), before it expired: `limit` (the row's bound on immediate
    /// takebacks) holds, and the lease is another incarnation's, or this worker's from a request
    /// that arrived no later than this one. `$other`, `$own` and `$arrived` are the parameter
    /// numbers `other_incarnations`, `own` and `arrived` are bound to. Equal-length strings of
    /// digits compare alike under any collation, on SQLite and PostgreSQL.
    pub fn reclaimable_sql(p: &str, limit: &str, other: u8, own: u8, arrived: u8) -> String {
        format!(
            "({limit} AND ((length(${other}) > 0 \
               AND substr({p}lease_owner, 1, length(${other})) = ${other} \
               AND substr({p}lease_owner, 1, length(${own})) <> ${own}) \
             OR (substr({p}lease_owner, 1, length(${own})) = ${own} \
               AND substr({p}lease_owner, length(${own}) + 1, 16) <= ${arrived})))"
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_names_the_worker_when_its_request_arrived_and_a_fresh_token() {
        let ask = LeaseAsk::new("enclave-a/7f3c", 1_796_473_657_123);
        assert_eq!(ask.other_incarnations, "enclave-a/");
        assert_eq!(ask.own, "enclave-a/7f3c~");
        let (worker, rest) = ask.holder.split_once(HOLDER_SEPARATOR).unwrap();
        assert_eq!(worker, "enclave-a/7f3c");
        assert_eq!(&rest[..16], "0001796473657123");
        assert_eq!(rest.len(), 28);
        assert_ne!(
            LeaseAsk::new("enclave-a/7f3c", 1).holder,
            LeaseAsk::new("enclave-a/7f3c", 1).holder
        );
        assert_eq!(LeaseAsk::new("solo", 5).other_incarnations, "");
    }
}
