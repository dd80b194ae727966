-- A job's listing (its round's completed contributions, in pages by ref) is read in the order of
-- this index, with no sort: the listing asks for the next page after the last ref it has, so
-- without `id` in the index each page sorted every completed contribution of the round again.
-- It serves every query the index it replaces did (its columns are a prefix of these).
DROP INDEX assignments_by_round;
CREATE INDEX assignments_by_round ON assignments (round_id, state, id);
