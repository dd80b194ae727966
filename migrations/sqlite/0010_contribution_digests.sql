-- The BLAKE3 of a contribution uploaded through the server, computed once as it arrives
-- (issue 15). Jobs list it, so an enclave commits to a round's inputs without reading them
-- first and checks each contribution against it as it opens it (a mismatch fails the job).
-- NULL for direct uploads to the blob store, which the enclave digests itself.
ALTER TABLE assignments ADD COLUMN contribution_blake3 TEXT;
