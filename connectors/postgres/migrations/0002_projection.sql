-- The Postgres projection of the run log (R27), written only by `agentruns sink`.
--
-- Every row is derived by folding agentruns.events with the core's transition; `sink_offsets`
-- holds the consumed Kafka positions and is written in the SAME transaction as the rows, so the
-- projection is exactly once: a restarted sink seeks to these offsets and re-applies nothing.
-- Every upsert is guarded by seq, so a row never moves backwards even if a batch is re-applied.
-- Times from event data are timestamptz (exact to the millisecond); durations are in ms.

CREATE TABLE IF NOT EXISTS runs (
    run_id          text PRIMARY KEY,
    last_seq        bigint NOT NULL CHECK (last_seq > 0),
    status          text NOT NULL,
    step            integer NOT NULL,
    attempt         integer NOT NULL,
    version         bigint NOT NULL,           -- state version (one per applied transition)
    resolution      integer NOT NULL,          -- corrections after a terminal state (R19)
    trace_id        text NOT NULL,
    goal            text NOT NULL,
    input_tokens    bigint NOT NULL,
    output_tokens   bigint NOT NULL,
    cost_micros     bigint NOT NULL,
    tool_calls      integer NOT NULL,
    started_at      timestamptz NOT NULL,
    last_event_at   timestamptz NOT NULL,
    ended_at        timestamptz,
    system_ms       bigint NOT NULL,           -- R16: time the system worked
    tool_wait_ms    bigint NOT NULL,           -- waiting for tools
    user_wait_ms    bigint NOT NULL,           -- waiting for a person (counts toward the SLA)
    outcome         text,
    result_ref      text,                      -- the terminal result artifact
    state           jsonb NOT NULL,            -- the folded RunState at last_seq (sink restart)
    projected_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status);
CREATE INDEX IF NOT EXISTS runs_last_event_at ON runs (last_event_at);

CREATE TABLE IF NOT EXISTS events (
    run_id          text NOT NULL,
    seq             bigint NOT NULL CHECK (seq > 0),
    event_id        text NOT NULL,
    type            text NOT NULL,
    step            integer NOT NULL,
    attempt         integer NOT NULL,
    trace_id        text NOT NULL,
    at              timestamptz NOT NULL,
    disposition     text NOT NULL,             -- as recorded by the processor
    reason          text,
    input_id        text,
    status          text NOT NULL,             -- the run status after this event (the fold)
    payload         jsonb NOT NULL,            -- the domain event
    projected_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, seq)
);
CREATE INDEX IF NOT EXISTS events_trace_id ON events (trace_id);

CREATE TABLE IF NOT EXISTS operations (
    run_id          text NOT NULL,
    op_key          text NOT NULL,             -- the idempotency key passed to the backend
    step            integer NOT NULL,
    tool            text NOT NULL,
    call_id         text NOT NULL,
    status          text NOT NULL,             -- OpStatus; UNKNOWN = pending reconciliation
    dispatch        integer NOT NULL,          -- attempts sent to the backend
    retries         integer NOT NULL,
    polls           integer NOT NULL,
    policy_decision text NOT NULL,
    result_ref      text,
    error_class     text,
    error_code      text,
    reconciliation  text,                      -- last ReconcileCompleted outcome, if any
    cancel_unconfirmed boolean NOT NULL,
    seq             bigint NOT NULL,           -- seq of the event that last changed it
    PRIMARY KEY (run_id, op_key)
);
CREATE INDEX IF NOT EXISTS operations_status ON operations (status);

CREATE TABLE IF NOT EXISTS questions (
    run_id          text NOT NULL,
    question_id     text NOT NULL,
    kind            text NOT NULL,
    artifact_ref    text NOT NULL,
    expires_at      timestamptz NOT NULL,
    token_id        text NOT NULL,             -- the single-use resume token's id (never a secret)
    state_version   bigint NOT NULL,
    status          text NOT NULL CHECK (status IN ('open', 'answered', 'expired', 'cancelled', 'closed')),
    opened_seq      bigint,                    -- NULL only until the opening row lands
    closed_seq      bigint,
    seq             bigint NOT NULL,
    PRIMARY KEY (run_id, question_id)
);
CREATE INDEX IF NOT EXISTS questions_open ON questions (expires_at) WHERE status = 'open';

-- Terminal results from agentruns.results, one per resolution (a correction adds one).
CREATE TABLE IF NOT EXISTS results (
    run_id          text NOT NULL,
    resolution      bigint NOT NULL,
    status          text NOT NULL,
    seq             bigint NOT NULL,
    result_ref      text,
    summary         text,
    trace_id        text NOT NULL,
    at              timestamptz NOT NULL,
    PRIMARY KEY (run_id, resolution)
);

-- The latest snapshot seen on agentruns.state per run (audit: snapshot vs projection vs log).
CREATE TABLE IF NOT EXISTS run_snapshots (
    run_id          text PRIMARY KEY,
    last_seq        bigint NOT NULL,
    version         bigint NOT NULL,
    status          text,
    updated_at      timestamptz NOT NULL
);

-- Artifact metadata without the content (the blobs stay in `artifacts`).
CREATE OR REPLACE VIEW artifact_metadata AS
    SELECT ref, media_type, size_bytes, created_at FROM artifacts;

-- Consumed positions, written in the same transaction as the rows they produced.
CREATE TABLE IF NOT EXISTS sink_offsets (
    consumer        text NOT NULL,             -- the sink's group id
    topic           text NOT NULL,
    partition       integer NOT NULL,
    next_offset     bigint NOT NULL CHECK (next_offset >= 0),
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, topic, partition)
);
