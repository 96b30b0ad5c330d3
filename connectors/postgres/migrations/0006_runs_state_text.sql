-- runs.state is the sink's restart cache: the folded RunState at last_seq, read back whole
-- (RunState JSON) and never queried inside. As jsonb, Postgres parsed and re-encoded ~4 KB per
-- run per batch, about half of each runs upsert; as text it is stored as the core wrote it.
-- Query it with state::jsonb when needed.
ALTER TABLE runs ALTER COLUMN state TYPE text USING state::text;
