-- Console sessions logged out before their cookie expires. A session cookie is signed and
-- carries its own expiry; log-out records the session here so every API process (several run
-- behind a load balancer) refuses the cookie from then on. Rows are removed once the cookie
-- would have expired anyway (at the next log-out), so the table holds at most twelve hours of
-- log-outs. `session_hash` is the SHA-256 of the session id, not the id itself.
CREATE TABLE IF NOT EXISTS console_revoked_sessions (
    session_hash text PRIMARY KEY,
    expires_at timestamptz NOT NULL
);
CREATE INDEX IF NOT EXISTS console_revoked_sessions_expires ON console_revoked_sessions (expires_at);
