-- confed task database, embedded default (SQLite). Types and SQL are kept to what PostgreSQL
-- also accepts: TEXT, BIGINT, DOUBLE PRECISION; timestamps are Unix milliseconds (BIGINT).

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
    id            TEXT PRIMARY KEY,
    task_id       TEXT NOT NULL REFERENCES tasks(id),
    round_number  BIGINT NOT NULL,
    attempt       BIGINT NOT NULL,
    state         TEXT NOT NULL,
    report_goal   BIGINT NOT NULL,
    min_reports   BIGINT NOT NULL,
    deadline_at   BIGINT NOT NULL,
    opened_at     BIGINT NOT NULL,
    closed_at     BIGINT,
    updated_at    BIGINT NOT NULL,
    UNIQUE (task_id, round_number, attempt)
);
CREATE INDEX rounds_by_state_deadline ON rounds (state, deadline_at);

CREATE TABLE assignments (
    id          TEXT PRIMARY KEY,
    round_id    TEXT NOT NULL REFERENCES rounds(id),
    state       TEXT NOT NULL,
    expires_at  BIGINT NOT NULL,
    created_at  BIGINT NOT NULL,
    updated_at  BIGINT NOT NULL
);
CREATE INDEX assignments_by_round ON assignments (round_id, state);

-- Every state transition of every entity, appended in the same transaction as the transition.
CREATE TABLE state_history (
    id          TEXT PRIMARY KEY,
    entity      TEXT NOT NULL,
    entity_id   TEXT NOT NULL,
    -- 1, 2, 3, ... per entity: orders transitions that share a millisecond.
    seq         BIGINT NOT NULL,
    from_state  TEXT,
    to_state    TEXT NOT NULL,
    reason      TEXT NOT NULL,
    at          BIGINT NOT NULL
);
CREATE UNIQUE INDEX state_history_by_entity ON state_history (entity_id, seq);
