-- Transient failures of an aggregation job, counted apart from its leases (`attempts`): a lease
-- taken over after a crash is not a failure, and transient failures are retried without limit
-- (with a capped backoff and an alert) instead of failing the task (issue 13).
ALTER TABLE aggregation_jobs ADD COLUMN failures BIGINT NOT NULL DEFAULT 0;
