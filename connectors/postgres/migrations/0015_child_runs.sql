-- Lineage of child runs (tools of kind run): the run whose call started a run, projected from
-- its state (RunState.parent) like every runs column; null for a run nobody started. A run's
-- children are the runs that name it (runs_parent).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS parent_run_id text;
CREATE INDEX IF NOT EXISTS runs_parent ON runs (parent_run_id) WHERE parent_run_id IS NOT NULL;
