-- Tenants: the tenant each run belongs to (docs/security.md), projected from its state
-- (RunState.tenant, absent for the default tenant) like every runs column. Every query of a
-- caller who is not an admin is narrowed to its tenant, so the run list's keyset order gets an
-- index that starts with it.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS tenant text NOT NULL DEFAULT 'default';
UPDATE runs SET tenant = state::json ->> 'tenant'
    WHERE state::json ->> 'tenant' IS NOT NULL AND tenant <> state::json ->> 'tenant';
CREATE INDEX IF NOT EXISTS runs_tenant_started ON runs (tenant, started_at DESC, run_id DESC);
