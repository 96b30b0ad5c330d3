-- MCP tasks the tool executor started (docs/tools.md, "MCP tasks"): a task-augmented tools/call
-- is answered with a task id of the server's choosing, written here (by the operation key)
-- before the executor answers ToolCallAccepted, so any executor, after a restart too, polls
-- (tasks/get, tasks/result) and cancels (tasks/cancel) the task the call started.
CREATE TABLE IF NOT EXISTS mcp_tasks (
    operation_key text PRIMARY KEY,
    server        text NOT NULL,
    task_id       text NOT NULL CHECK (length(task_id) <= 256),
    created_at    timestamptz NOT NULL DEFAULT now()
);
