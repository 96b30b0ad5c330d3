-- The console's step latency chart reads the events of the last two hours by time, with the
-- run and step of each (an index-only scan when the visibility map allows it).
CREATE INDEX IF NOT EXISTS events_at ON events (at) INCLUDE (run_id, step);
