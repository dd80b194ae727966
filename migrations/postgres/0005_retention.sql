-- Local retention (issue 13): a closed round's contributions (assignment rows, their history,
-- stored bytes) are deleted once the retention window after its close has passed; the round
-- row, its counters and its release stay. `contributions_purged_at` says when.
ALTER TABLE rounds ADD COLUMN contributions_purged_at BIGINT;
CREATE INDEX rounds_to_purge ON rounds (closed_at) WHERE contributions_purged_at IS NULL;
