-- Each release's proof of origin: the enclave's signature and the key services' receipts (JSON,
-- docs/attestation.md). Releases committed before proofs existed have none.
ALTER TABLE releases ADD COLUMN proof_json TEXT;
