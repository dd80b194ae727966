-- The idempotency digest of an assignment's contribution is named for what it holds: a prefixed
-- digest (`blake3:<hex>` for uploads through the server, `md5:<hex>` for direct uploads to the
-- blob store, a bare SHA-256 hex in rows stored before BLAKE3), not only SHA-256 (issue 30).
ALTER TABLE assignments RENAME COLUMN contribution_sha256 TO contribution_digest;
