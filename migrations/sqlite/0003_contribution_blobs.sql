-- Contributions of the embedded default live in the task database: stored by the same group
-- commit as their rows, one fsync shared by many uploads instead of a file, an inode and two
-- fsyncs each. Models and aggregates stay in the blob directory.
CREATE TABLE blobs (
    key     TEXT PRIMARY KEY,
    sha256  TEXT NOT NULL,
    bytes   BLOB NOT NULL
);
