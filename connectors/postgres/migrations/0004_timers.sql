-- Durable timers of the timer service (R1: time enters the core only as TimerFired inputs).
-- One row per (run_id, timer_id), upserted from ScheduleTimer/CancelTimer effects; a row fires
-- once (fired_at set after its TimerFired input is produced; a crash in between re-fires a
-- byte-identical input that the processor drops as an exact duplicate).
CREATE TABLE IF NOT EXISTS timers (
    run_id       text NOT NULL,
    timer_id     text NOT NULL,
    purpose      text NOT NULL,
    due_at       bigint NOT NULL,           -- ms since epoch
    trace_id     text NOT NULL,
    step         integer NOT NULL,
    attempt      integer NOT NULL,
    cancelled    boolean NOT NULL DEFAULT false,
    fired_at     bigint,                    -- ms since epoch, wall clock of the timer service
    created_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, timer_id)
);
CREATE INDEX IF NOT EXISTS timers_due ON timers (due_at) WHERE fired_at IS NULL AND NOT cancelled;
