-- Content-addressed, write-once artifact store (R2, R7, R14): the context of a step, model
-- candidates, tool outputs, questions and results. ref = 'sha256:' || hex(sha256(content)).
-- Written before any event that references it is committed; never updated, never deleted by
-- the pipeline. Size limit: 16 MiB per artifact (enforced by the writer).
CREATE TABLE IF NOT EXISTS artifacts (
    ref         text PRIMARY KEY CHECK (ref ~ '^sha256:[0-9a-f]{64}$'),
    media_type  text NOT NULL,
    size_bytes  integer NOT NULL CHECK (size_bytes >= 0),
    content     bytea NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
