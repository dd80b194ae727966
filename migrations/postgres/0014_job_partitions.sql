-- Partitioned rounds (issue 33): a large round's job is cut into partitions, each leased by an
-- enclave worker of its own, which stores its partition's exact sums sealed (only an enclave
-- holding the round's key opens them); the round's job (the root) is leased only once every
-- partition is stored, and merges them. `partitions` is NULL until the first lease plans the
-- job: 1 (one worker does everything, as before) or the number of rows below.
ALTER TABLE aggregation_jobs ADD COLUMN partitions BIGINT;

CREATE TABLE job_partitions (
    round_id          TEXT NOT NULL REFERENCES rounds(id),
    partition_index   BIGINT NOT NULL,
    partition_count   BIGINT NOT NULL,
    lease_owner       TEXT,
    lease_expires_at  BIGINT,
    attempts          BIGINT NOT NULL DEFAULT 0,
    -- The blob key of the sealed partition, once its worker stored it (then never leased again).
    sealed_key        TEXT,
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL,
    PRIMARY KEY (round_id, partition_index)
);
-- The partitions still to store: what leases and the due-time query look for.
CREATE INDEX job_partitions_open ON job_partitions (round_id) WHERE sealed_key IS NULL;
