-- Per-round counters kept in the same transaction as every assignment transition, so check-in
-- capacity and the report goal cost one row read instead of a count over the round's assignments.
ALTER TABLE rounds ADD COLUMN live_assignments BIGINT NOT NULL DEFAULT 0;
ALTER TABLE rounds ADD COLUMN completed_reports BIGINT NOT NULL DEFAULT 0;
UPDATE rounds SET
    live_assignments = (SELECT COUNT(*) FROM assignments a
                        WHERE a.round_id = rounds.id AND a.state IN ('ASSIGNED', 'UPLOADED', 'COMPLETED')),
    completed_reports = (SELECT COUNT(*) FROM assignments a
                         WHERE a.round_id = rounds.id AND a.state = 'COMPLETED');
