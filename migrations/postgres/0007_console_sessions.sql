-- Console sign-ins (issue 16): a browser session is a random 256-bit secret in an HttpOnly cookie;
-- only its SHA-256 is stored, so a copy of this table signs nobody in. The tenant's API token is
-- never stored here nor in the browser. Rows past `expires_at` are refused and purged.
CREATE TABLE console_sessions (
    id_sha256   TEXT PRIMARY KEY,
    tenant_id   TEXT NOT NULL REFERENCES tenants(id),
    created_at  BIGINT NOT NULL,
    expires_at  BIGINT NOT NULL
);
CREATE INDEX console_sessions_by_expiry ON console_sessions (expires_at);
