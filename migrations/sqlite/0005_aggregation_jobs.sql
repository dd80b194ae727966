-- Aggregation jobs and releases. A job is created in the same transaction that moves its round to
-- AGGREGATING; enclave workers lease it (owner + expiry, renewed while working; an expired lease
-- may be taken over). A round's release is recorded once, in the transaction that moves the
-- round to APPLYING; the primary key makes a second release impossible.

CREATE TABLE aggregation_jobs (
    round_id          TEXT PRIMARY KEY REFERENCES rounds(id),
    task_id           TEXT NOT NULL REFERENCES tasks(id),
    -- PENDING (to do or leased), DONE, FAILED
    state             TEXT NOT NULL,
    lease_owner       TEXT,
    lease_expires_at  BIGINT,
    -- Not leased again before this time (backoff after a failed attempt).
    not_before        BIGINT NOT NULL,
    attempts          BIGINT NOT NULL DEFAULT 0,
    last_error        TEXT,
    created_at        BIGINT NOT NULL,
    updated_at        BIGINT NOT NULL
);
CREATE INDEX aggregation_jobs_ready ON aggregation_jobs (state, not_before);

CREATE TABLE releases (
    round_id         TEXT PRIMARY KEY REFERENCES rounds(id),
    task_id          TEXT NOT NULL REFERENCES tasks(id),
    round_number     BIGINT NOT NULL,
    average_key      TEXT NOT NULL,
    average_sha256   TEXT NOT NULL,
    manifest_key     TEXT NOT NULL,
    manifest_json    TEXT NOT NULL,
    included         BIGINT NOT NULL,
    excluded         BIGINT NOT NULL,
    epsilon_spent    DOUBLE PRECISION NOT NULL,
    created_at       BIGINT NOT NULL,
    UNIQUE (task_id, round_number)
);
