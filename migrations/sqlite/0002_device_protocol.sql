-- Device protocol: each round encrypts to one key; assignments record their contribution.

ALTER TABLE rounds ADD COLUMN key_id TEXT;

-- `assignments.id` is the SHA-256 (hex) of the assignment capability the device holds, so reading
-- the database does not yield usable capabilities.
ALTER TABLE assignments ADD COLUMN contribution_sha256 TEXT;
ALTER TABLE assignments ADD COLUMN contribution_bytes BIGINT;
ALTER TABLE assignments ADD COLUMN blob_key TEXT;
ALTER TABLE assignments ADD COLUMN device_error TEXT;
CREATE INDEX assignments_by_expiry ON assignments (state, expires_at);
