-- Server optimizers (issue 17): the optimizer state (moments) after the round that made a model
-- version, a write-once blob next to the model (NULL for FedAvg, and for version 0).
ALTER TABLE models ADD COLUMN optimizer_state_key TEXT;
