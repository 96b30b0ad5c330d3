-- The dead-letter topic (`<prefix>.dlq`) projected by the sink, in the same transaction as its
-- offsets, so the console reads a table instead of the topic. Keyed by where the refused
-- record was (source topic, partition, offset): a dead letter written twice (the adapters that
-- refuse outside a Kafka transaction write at least once) or re-read after a sink restart is
-- one row. The original key and value are kept up to 4 KiB each, with their whole size beside
-- them; a record on the topic that is not a DeadLetter is a row keyed by its own position.
CREATE TABLE IF NOT EXISTS dead_letters (
    source_topic        text NOT NULL,
    source_partition    integer NOT NULL,
    source_offset       bigint NOT NULL,
    reason              text NOT NULL,
    error_class         text NOT NULL,
    at                  timestamptz NOT NULL,      -- when the record was refused
    run_id              text,
    original_key        bytea,                     -- the first 4 KiB
    key_bytes           integer NOT NULL,          -- the whole key's size
    original_value      bytea,                     -- the first 4 KiB
    value_bytes         bigint NOT NULL,           -- the whole value's size
    original_timestamp  timestamptz,
    dlq_partition       integer NOT NULL,          -- where the dead letter itself is
    dlq_offset          bigint NOT NULL,
    projected_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (source_topic, source_partition, source_offset)
);
-- The console's page: newest first with a keyset cursor, all of them or one error class.
CREATE INDEX IF NOT EXISTS dead_letters_at
    ON dead_letters (at DESC, source_topic DESC, source_partition DESC, source_offset DESC);
CREATE INDEX IF NOT EXISTS dead_letters_class
    ON dead_letters (error_class, at DESC, source_topic DESC, source_partition DESC, source_offset DESC);
