-- confed task database on PostgreSQL (scale-out). The same tables, columns and types as the
-- SQLite migrations 0001-0005 produce, in one step; timestamps are Unix milliseconds (BIGINT).
-- Later changes get a migration for each engine.

CREATE TABLE tenants (
    id                TEXT PRIMARY KEY,
    name              TEXT NOT NULL UNIQUE,
    token_id          TEXT NOT NULL UNIQUE,
    token_sha256      TEXT NOT NULL,
    max_active_tasks  BIGINT NOT NULL,
    max_report_goal   BIGINT NOT NULL,
    -- Bumped to take the tenant's row lock before quota checks (portable SELECT ... FOR UPDATE).
    lock_version      BIGINT NOT NULL DEFAULT 0,
    created_at        BIGINT NOT NULL
);

CREATE TABLE tasks (
    id             TEXT PRIMARY KEY,
    tenant_id      TEXT NOT NULL REFERENCES tenants(id),
    population     TEXT NOT NULL,
    state          TEXT NOT NULL,
    spec_json      TEXT NOT NULL,
    current_round  BIGINT NOT NULL DEFAULT 0,
    model_version  BIGINT,
    created_at     BIGINT NOT NULL,
    updated_at     BIGINT NOT NULL
);
CREATE INDEX tasks_by_tenant ON tasks (tenant_id, created_at DESC, id DESC);
CREATE INDEX tasks_by_population ON tasks (population, state);

CREATE TABLE models (
    task_id     TEXT NOT NULL REFERENCES tasks(id),
    version     BIGINT NOT NULL,
    blob_key    TEXT NOT NULL,
    sha256      TEXT NOT NULL,
    size_bytes  BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    PRIMARY KEY (task_id, version)
);

CREATE TABLE rounds (
    id                 TEXT PRIMARY KEY,
    task_id            TEXT NOT NULL REFERENCES tasks(id),
    round_number       BIGINT NOT NULL,
    attempt            BIGINT NOT NULL,
    state              TEXT NOT NULL,
    report_goal        BIGINT NOT NULL,
    min_reports        BIGINT NOT NULL,
    deadline_at        BIGINT NOT NULL,
    opened_at          BIGINT NOT NULL,
    closed_at          BIGINT,
    updated_at         BIGINT NOT NULL,
    key_id             TEXT,
    live_assignments   BIGINT NOT NULL DEFAULT 0,
    completed_reports  BIGINT NOT NULL DEFAULT 0,
    UNIQUE (task_id, round_number, attempt)
);
CREATE INDEX rounds_by_state_deadline ON rounds (state, deadline_at);

-- `id` is the SHA-256 (hex) of the assignment capability the device holds.
CREATE TABLE assignments (
    id                   TEXT PRIMARY KEY,
    round_id             TEXT NOT NULL REFERENCES rounds(id),
    state                TEXT NOT NULL,
    expires_at           BIGINT NOT NULL,
    created_at           BIGINT NOT NULL,
    updated_at           BIGINT NOT NULL,
    contribution_sha256  TEXT,
    contribution_bytes   BIGINT,
    blob_key             TEXT,
    device_error         TEXT
);
CREATE INDEX assignments_by_round ON assignments (round_id, state);
CREATE INDEX assignments_by_expiry ON assignments (state, expires_at);

-- Every state transition of every entity, appended in the same transaction as the transition.
CREATE TABLE state_history (
    id          TEXT PRIMARY KEY,
    entity      TEXT NOT NULL,
    entity_id   TEXT NOT NULL,
    seq         BIGINT NOT NULL,
    from_state  TEXT,
    to_state    TEXT NOT NULL,
    reason      TEXT NOT NULL,
    at          BIGINT NOT NULL
);
CREATE UNIQUE INDEX state_history_by_entity ON state_history (entity_id, seq);

-- Only read as a fallback for contributions an older SQLite deployment stored in its database;
-- kept so both engines have the same tables.
CREATE TABLE blobs (
    key     TEXT PRIMARY KEY,
    sha256  TEXT NOT NULL,
    bytes   BYTEA NOT NULL
);

CREATE TABLE aggregation_jobs (
    round_id          TEXT PRIMARY KEY REFERENCES rounds(id),
    task_id           TEXT NOT NULL REFERENCES tasks(id),
    state             TEXT NOT NULL,
    lease_owner       TEXT,
    lease_expires_at  BIGINT,
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
