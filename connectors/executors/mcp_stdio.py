"""stdio MCP servers: a process the tool executor starts and speaks to in newline-delimited
JSON-RPC on its stdin and stdout (MCP's stdio transport). The session logic is
:class:`agentruns.connectors.executors.mcp_client.MCPSession`'s; this is its wire.

- The process is started by the session's ``initialize`` (the first call, or the first after
  the process ended), with the entry's ``command`` and ``args`` and an environment of the
  executor's :data:`INHERITED_ENV` variables and the entry's ``env`` alone, in a process group
  of its own; its stderr is the executor's. It must answer ``initialize`` within
  ``start_timeout_ms`` of its start, or it is stopped (nothing of the call sent).
- A process that ends (or closes its stdout) is started again by the next call, after a pause
  that doubles while it keeps ending before it answered ``initialize`` (0.5 s to 30 s). The
  calls waiting on it: their outcome is unknown (sent, no answer); a call that finds it gone is
  sent to the next one (nothing of it had left).
- A line read is one message of at most ``max_line_bytes``: a longer one is skipped to its end
  (never held whole), and so is a line that is not JSON; the call whose id the line starts with
  (``{"jsonrpc": "2.0", "id": N``) gets ``too_large`` / ``invalid`` for it, as over HTTP. An
  answer to an id no call waits for is dropped and logged (the call it was meant for, if any,
  ends at its deadline: unknown).
- Requests of the server's: ``ping`` is answered, any other refused (``-32601``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import msgspec

from agentruns.connectors.executors.base import decode_json
from agentruns.connectors.executors.mcp_client import LIST_CHANGED, Reply, reply_of
from agentruns.connectors.executors.mcp_rules import INHERITED_ENV, MCPServerSpec, StdioCommand

log = logging.getLogger("agentruns.executor.tool.mcp")

READ_CHUNK = 64 * 1024
HEAD_BYTES = 256  # of a line skipped, kept to find whose answer it was
#: The id of a message whose line cannot be read whole: its first or second member.
LEADING_ID = re.compile(rb'\s*\{\s*(?:"jsonrpc"\s*:\s*"2\.0"\s*,\s*)?"id"\s*:\s*(\d{1,18})\s*[,}]')
RESTART_PAUSE_S = (0.5, 30.0)
STOP_WAIT_S = 1.0
MAX_UNREAD_BYTES = 1024 * 1024  # answers to the server's requests it has not read yet
STRAY_LOG_S = 10.0  # dropped lines are logged at most this often (with their count)


class StdioWire:
    """One stdio server's process and the calls waiting for its answers (the executor's event
    loop only). The session it names is the process: each start is a new one."""

    def __init__(self, spec: MCPServerSpec) -> None:
        assert spec.stdio is not None
        self.spec = spec
        self.command: StdioCommand = spec.stdio
        self.process: asyncio.subprocess.Process | None = None
        self.generation = 0
        self.starts = 0
        self.waiting: dict[int, asyncio.Future[Reply]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._started_at = 0.0
        self._answered = False  # the running process answered ``initialize``
        self._exited_at = float("-inf")
        self._pause = RESTART_PAUSE_S[0]
        self._list_changed = False
        self._strays = 0
        self._stray_logged = float("-inf")

    @property
    def session(self) -> object:
        return self.generation

    def alive(self) -> bool:
        process, reader = self.process, self._reader
        return (
            process is not None
            and process.returncode is None
            and reader is not None
            and not reader.done()
        )

    def opened(self, protocol: str) -> None:
        pass  # the protocol version rides on no message of stdio

    def forget(self) -> None:
        pass  # the process is gone already: the next ``initialize`` starts another

    async def close(self, timeout_s: float) -> None:
        await self._stop("the executor closes the session", min(timeout_s, STOP_WAIT_S))

    # -- one message --

    async def exchange(
        self, message: Mapping[str, Any], timeout_s: float, *, opening: bool = False
    ) -> Reply:
        deadline = time.monotonic() + timeout_s
        if opening:
            failed = await self._start(deadline)
            if failed is not None:
                return failed
            deadline = min(deadline, self._started_at + self.command.start_timeout_ms / 1000)
        elif not self.alive():
            return Reply("session_lost", sent=False, detail="the server process is not running")
        request_id = message.get("id")
        future: asyncio.Future[Reply] | None = None
        if isinstance(request_id, int):
            future = asyncio.get_running_loop().create_future()
            self.waiting[request_id] = future
        try:
            failed = await self._write(message, deadline)
            if failed is not None:
                return failed
            if future is None:
                return Reply("accepted")
            try:
                reply = await asyncio.wait_for(future, max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                if opening:
                    ms = self.command.start_timeout_ms
                    why = f"no answer to initialize within {ms} ms"
                    await self._stop(why, STOP_WAIT_S, failed=True)
                    return Reply("unknown", detail=f"no answer to initialize within {ms} ms")
                return Reply("unknown", detail="no answer by the deadline")
        finally:
            if isinstance(request_id, int):
                self.waiting.pop(request_id, None)
        if opening and reply.kind == "result":
            self._answered = True
        if self._list_changed:
            self._list_changed = False
            reply = replace(reply, list_changed=True)
        return reply

    async def _write(self, message: Mapping[str, Any], deadline: float) -> Reply | None:
        """Write one line (JSON never holds a raw newline); None when it was written."""
        process = self.process
        if process is None or process.stdin is None or process.stdin.is_closing():
            return Reply("session_lost", sent=False, detail="the server process is not running")
        try:
            process.stdin.write(msgspec.json.encode(message) + b"\n")
            await asyncio.wait_for(process.stdin.drain(), max(deadline - time.monotonic(), 0.001))
        except (BrokenPipeError, ConnectionResetError):  # it ended before reading any of it
            return Reply("session_lost", sent=False, detail="the server process's stdin closed")
        except TimeoutError:  # part of it may be read later: its outcome is unknown
            return Reply("unknown", detail="the server process does not read its stdin")
        return None

    # -- the process --

    async def _start(self, deadline: float) -> Reply | None:
        """Stop what runs, wait for the restart pause, start the command; None when started."""
        await self._stop("a new session", STOP_WAIT_S)
        pause = self._exited_at + self._pause - time.monotonic()
        if pause > 0:
            if time.monotonic() + pause >= deadline:
                return Reply("not_sent", detail=f"the server process restarts in {pause:.1f} s")
            await asyncio.sleep(pause)
        env = {name: os.environ[name] for name in INHERITED_ENV if name in os.environ}
        env.update({name: secret.reveal() for name, secret in self.command.env.items()})
        try:
            process = await asyncio.create_subprocess_exec(
                self.command.command,
                *self.command.args,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,  # its own group: stopped whole, spared our signals
            )
        except OSError as exc:
            self._ended()
            detail = f"cannot start {self.command.command[:200]}: {exc.strerror or exc}"
            return Reply("not_sent", detail=detail)
        self.process, self.generation = process, self.generation + 1
        self.starts += 1
        self._started_at, self._answered = time.monotonic(), False
        self._reader = asyncio.get_running_loop().create_task(self._read(process))
        return None

    def _ended(self) -> None:
        """A process ended: the next start waits; longer while none answers ``initialize``."""
        self._exited_at = time.monotonic()
        if self._answered:
            self._pause = RESTART_PAUSE_S[0]
        else:
            self._pause = min(self._pause * 2, RESTART_PAUSE_S[1])

    def _fail_waiting(self, detail: str) -> None:
        for future in self.waiting.values():
            if not future.done():
                future.set_result(Reply("unknown", detail=detail))

    async def _stop(self, why: str, wait_s: float, *, failed: bool = False) -> None:
        """End the process (stdin closed, then SIGTERM, then SIGKILL to its group); the calls
        waiting on it: unknown. ``failed``: it did not start (the next start pauses)."""
        process, reader = self.process, self._reader
        self.process = self._reader = None
        if process is None:
            return
        self._fail_waiting(f"the server process was stopped: {why}")
        if process.returncode is None:
            with contextlib.suppress(OSError, RuntimeError):
                if process.stdin is not None:
                    process.stdin.close()
            for sent in (None, signal.SIGTERM, signal.SIGKILL):
                if sent is not None:
                    with contextlib.suppress(OSError):
                        os.killpg(process.pid, sent)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(process.wait(), wait_s)
                    break
        if reader is not None:
            reader.cancel()
        if failed:
            self._ended()

    async def _read(self, process: asyncio.subprocess.Process) -> None:
        """Read the process's stdout line by line until it ends."""
        assert process.stdout is not None
        limit = self.command.max_line_bytes
        line = bytearray()
        skipped: bytearray | None = None  # the head of a line over the limit, being skipped
        why = "its stdout ended"
        try:
            while chunk := await process.stdout.read(READ_CHUNK):
                start = 0
                while start <= len(chunk):
                    end = chunk.find(b"\n", start)
                    piece = chunk[start : len(chunk) if end < 0 else end]
                    if skipped is not None:
                        skipped += piece[: max(0, HEAD_BYTES - len(skipped))]
                    else:
                        line += piece
                        if len(line) > limit:
                            skipped = bytearray(line[:HEAD_BYTES])
                            line.clear()
                    if end < 0:
                        break
                    if skipped is not None:
                        self._unreadable(bytes(skipped), "too_large", f"a line over {limit} bytes")
                        skipped = None
                    else:
                        self._line(bytes(line))
                        line.clear()
                    start = end + 1
        except (OSError, ValueError) as exc:
            why = f"reading its stdout failed: {exc}"
        if self.process is not process:
            return  # stopped on purpose
        # it ended on its own: the calls waiting on it now, before another process starts
        self.process = self._reader = None
        self._fail_waiting(f"the server process ended ({why})")
        self._ended()
        with contextlib.suppress(OSError):
            os.killpg(process.pid, signal.SIGKILL)  # it may live on with its stdout closed
        code = await process.wait()
        log.warning("MCP server %s: its process ended (%s, status %s)", self.spec.name, why, code)

    def _line(self, raw: bytes) -> None:
        """One message from the server."""
        raw = raw.rstrip(b"\r")
        if not raw.strip():
            return
        value, problem = decode_json(raw)
        if problem is not None:
            self._unreadable(raw[:HEAD_BYTES], "invalid", problem)
            return
        if not isinstance(value, dict):
            self._stray("a line that is not a JSON-RPC message")
            return
        method, request_id = value.get("method"), value.get("id")
        if method is not None:
            if "id" in value:
                self._answer_request(value)
            elif method == LIST_CHANGED:
                self._list_changed = True
            return
        future = self._waiting_for(request_id)
        if future is None:
            self._stray(f"an answer to id {request_id!r:.40} that no call waits for")
        elif value.get("jsonrpc") != "2.0":
            future.set_result(Reply("invalid", detail="not_jsonrpc"))
        else:
            future.set_result(reply_of(value))

    def _waiting_for(self, request_id: Any) -> asyncio.Future[Reply] | None:
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            return None
        future = self.waiting.get(request_id)
        return None if future is None or future.done() else future

    def _unreadable(self, head: bytes, kind: str, detail: str) -> None:
        """A line that could not be read: the answer of the call its leading id names."""
        match = LEADING_ID.match(head)
        future = self._waiting_for(int(match.group(1))) if match else None
        if future is None:
            self._stray(f"{detail} (no call's id at its start)")
        else:
            future.set_result(Reply(kind, detail=detail))

    def _answer_request(self, request: Mapping[str, Any]) -> None:
        """A request of the server's: ``ping`` answered, anything else refused."""
        if request.get("method") == "ping":
            answer: dict[str, Any] = {"jsonrpc": "2.0", "id": request["id"], "result": {}}
        else:
            error = {"code": -32601, "message": "not supported by this client"}
            answer = {"jsonrpc": "2.0", "id": request["id"], "error": error}
        process = self.process
        if process is None or process.stdin is None or process.stdin.is_closing():
            return
        if process.stdin.transport.get_write_buffer_size() > MAX_UNREAD_BYTES:
            self._stray("a request while the server reads nothing of its stdin")
            return  # a server that asks and never reads: what it was not told, it never gets
        with contextlib.suppress(OSError, RuntimeError):
            process.stdin.write(msgspec.json.encode(answer) + b"\n")

    def _stray(self, what: str) -> None:
        self._strays += 1
        now = time.monotonic()
        if now - self._stray_logged >= STRAY_LOG_S:
            self._stray_logged = now
            log.warning(
                "MCP server %s: dropped %s (%d dropped lines so far)",
                self.spec.name,
                what,
                self._strays,
            )


__all__ = ["StdioWire"]
