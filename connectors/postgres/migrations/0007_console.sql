-- Indexes of the run list (GET /runs and the console's runs page). The list is ordered by
-- (started_at, run_id) descending, which never changes for a run, so a keyset cursor neither
-- skips nor repeats a row while runs progress; a status filter walks its own index in the same
-- order, the stuck filter (the scanner's rule) the live runs only (its list of terminal
-- statuses is the scanner's TERMINAL_SQL, written out). Search by trace id is an equality on
-- runs.trace_id; the finished-per-minute chart reads the runs that ended in the last hour.
CREATE INDEX IF NOT EXISTS runs_started ON runs (started_at DESC, run_id DESC);
CREATE INDEX IF NOT EXISTS runs_status_started ON runs (status, started_at DESC, run_id DESC);
CREATE INDEX IF NOT EXISTS runs_trace_id ON runs (trace_id);
CREATE INDEX IF NOT EXISTS runs_ended ON runs (ended_at) WHERE ended_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS runs_live_started ON runs (started_at DESC, run_id DESC)
    WHERE status NOT IN ('BUDGET_EXHAUSTED', 'CANCELLED', 'CANCEL_UNKNOWN', 'EXPIRED', 'FAILED', 'SUCCEEDED');
