-- A job's listing (its round's completed contributions, in pages by ref) is read in the order of
-- this index, with no sort: the listing asks for the next page after the last ref it has, so
-- without such an index each page sorted every completed contribution of the round after it.
-- Partial, with exactly the listing's conditions: an assignment enters it once, when it
-- completes, and the index holds completed contributions only.
CREATE INDEX assignments_completed_by_round ON assignments (round_id, id)
    WHERE state = 'COMPLETED' AND blob_key IS NOT NULL;
