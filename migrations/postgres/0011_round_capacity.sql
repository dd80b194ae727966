-- Adaptive over-selection (issue 17): how many devices a round may have assigned at once, fixed
-- when it opens from the task's over_selection and the previous round's drop-out rate. NULL for
-- rounds opened before: their task's over_selection applies.
ALTER TABLE rounds ADD COLUMN capacity BIGINT;
