-- The HTTP API's own bookkeeping (connectors/api.py), never written by anything else.
--
-- api_inputs: every input the API produced to the inbox, by input_id, with the EXACT encoded
-- record. A repeated request (same Idempotency-Key, a retried callback, a cancel sent twice)
-- re-uses the row: the same run is returned, and if the first attempt never reached Kafka the
-- byte-identical record is produced again (the processor drops an exact duplicate).
-- request_hash tells a true repeat from a different request re-using the same key.
CREATE TABLE IF NOT EXISTS api_inputs (
    input_id        text PRIMARY KEY,
    run_id          text NOT NULL,
    kind            text NOT NULL,             -- the core event type
    request_hash    text NOT NULL,             -- sha256 of the canonical request
    record          bytea NOT NULL,            -- the encoded Input, re-produced byte-identical
    produced        boolean NOT NULL DEFAULT false,
    created_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS api_inputs_run ON api_inputs (run_id);

-- Resume tokens already presented with a reply (R15: consumed once). The token id is not a
-- secret (it is derived by the core); the signed token is never stored.
CREATE TABLE IF NOT EXISTS api_used_tokens (
    token_id        text PRIMARY KEY,
    run_id          text NOT NULL,
    question_id     text NOT NULL,
    input_id        text NOT NULL,
    used_at         timestamptz NOT NULL DEFAULT now()
);
