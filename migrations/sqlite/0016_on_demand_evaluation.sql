-- On-demand evaluation (issue 17): a partner's request waits on the task until its next round
-- opens, which then evaluates (rounds.on_demand_evaluation = 1; a retried attempt of the same
-- round keeps it). 0 for everything before.
ALTER TABLE tasks ADD COLUMN evaluation_requested BIGINT NOT NULL DEFAULT 0;
ALTER TABLE rounds ADD COLUMN on_demand_evaluation BIGINT NOT NULL DEFAULT 0;
