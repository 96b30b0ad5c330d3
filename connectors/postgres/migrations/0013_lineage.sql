-- Lineage of forks (`agentruns fork`, `agentruns resume`): the run a fork was forked from and
-- the seq it was forked at, projected from its state (RunState.forked_from) like every runs
-- column; null for a submitted run. A run's forks are the runs that name it (runs_forked_from).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS forked_from_run_id text;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS forked_from_seq bigint;
CREATE INDEX IF NOT EXISTS runs_forked_from ON runs (forked_from_run_id)
    WHERE forked_from_run_id IS NOT NULL;
