-- Executed-action records (R25): one row per effect idempotency key, written by the model and
-- tool executors. 'started' is written BEFORE the outside call; 'completed' (with the exact
-- Input record the executor produced) is written BEFORE the Kafka transaction that carries
-- that input commits. A redelivered effect whose row is 'completed' is answered by re-sending
-- input_json verbatim (same input_id, same at, same body), never by a second call; a row that
-- is only 'started' means a crash between the call and the commit: the tool executor then
-- reconciles (status look-up by operation key) instead of calling blindly again.
CREATE TABLE IF NOT EXISTS executed_actions (
    idempotency_key text PRIMARY KEY,
    effect_type     text NOT NULL,
    run_id          text NOT NULL,
    step            integer NOT NULL,
    attempt         integer NOT NULL,
    operation_key   text,
    status          text NOT NULL CHECK (status IN ('started', 'completed')),
    starts          integer NOT NULL DEFAULT 1 CHECK (starts >= 1),
    result_kind     text,
    input_id        text,
    input_json      text,
    detail          text,
    executor        text NOT NULL,
    started_at      timestamptz NOT NULL DEFAULT now(),
    completed_at    timestamptz,
    CHECK (status = 'started' OR (input_json IS NOT NULL AND completed_at IS NOT NULL))
);

CREATE INDEX IF NOT EXISTS executed_actions_run ON executed_actions (run_id, step);
CREATE INDEX IF NOT EXISTS executed_actions_operation ON executed_actions (operation_key)
    WHERE operation_key IS NOT NULL;
