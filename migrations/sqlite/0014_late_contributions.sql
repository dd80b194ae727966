-- Stragglers (issue 17): when a device first tried to upload, or reported completed, after its
-- round had closed. The funnel counts these as late; NULL for every other assignment.
ALTER TABLE assignments ADD COLUMN late_at BIGINT;
