-- Compute budgets (issue 17): the device time a tenant's active tasks may ask for at once, in
-- device-hours; task creation refuses a task that would go over it.
ALTER TABLE tenants ADD COLUMN max_device_hours BIGINT NOT NULL DEFAULT 100000;
