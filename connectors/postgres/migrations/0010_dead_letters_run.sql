-- GET /runs/{id} of a run not yet projected shows the dead letters of its inputs (why a
-- submission has not started): found by run id, newest first.
CREATE INDEX IF NOT EXISTS dead_letters_run
    ON dead_letters (run_id, at DESC, source_topic DESC, source_partition DESC, source_offset DESC)
    WHERE run_id IS NOT NULL;
