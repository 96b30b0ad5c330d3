-- A timer belongs to the deployment (topic prefix) whose processor scheduled it: a timer
-- service fires only its own deployment's timers, into its own inbox, even where several
-- deployments share one database. Rows written before this column existed have the prefix ''
-- and are fired by whichever timer service finds them first, as before.
ALTER TABLE timers ADD COLUMN IF NOT EXISTS prefix text NOT NULL DEFAULT '';
ALTER TABLE timers DROP CONSTRAINT IF EXISTS timers_pkey;
ALTER TABLE timers ADD PRIMARY KEY (prefix, run_id, timer_id);
DROP INDEX IF EXISTS timers_due;
CREATE INDEX IF NOT EXISTS timers_due ON timers (prefix, due_at) WHERE fired_at IS NULL AND NOT cancelled;
