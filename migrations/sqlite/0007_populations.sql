-- A population belongs to one tenant: only its tasks may run on it (issue 13: populations were a
-- global namespace and another tenant's task could take its devices). Existing populations go to
-- the tenant of their earliest task.
CREATE TABLE populations (
    name       TEXT PRIMARY KEY,
    tenant_id  TEXT NOT NULL REFERENCES tenants(id),
    created_at BIGINT NOT NULL
);
CREATE INDEX populations_by_tenant ON populations (tenant_id, name);
INSERT OR IGNORE INTO populations (name, tenant_id, created_at)
    SELECT population, tenant_id, created_at FROM tasks ORDER BY created_at, id;
