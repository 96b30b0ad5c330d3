-- When each API credential was last used (ms since the epoch), shared by every API process
-- (several run behind a load balancer, and each restarts with an empty memory): an operator
-- deciding whether a credential can be removed sees its latest use anywhere. Each process
-- writes a credential's time at most once a minute, with GREATEST, so no process moves it back.
-- Ids only, never a token or its hash. A process that sees a credential removed from the
-- credentials file deletes its row (an id removed and added again names a new credential).
CREATE TABLE IF NOT EXISTS credential_use (
    credential_id text PRIMARY KEY,
    last_used_at bigint NOT NULL
);
