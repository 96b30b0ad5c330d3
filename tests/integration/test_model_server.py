"""The scripted model server over real loopback HTTP (no broker needed)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from agentruns.connectors.testing import model_server
from agentruns.connectors.testing.httpserver import ServerHandle

SCENARIOS = Path(model_server.__file__).with_name("scenarios")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    handle = model_server.serve("127.0.0.1", 0)
    yield handle
    handle.close()


@pytest.fixture
def client(server: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=5.0) as c:
        c.post("/reset").raise_for_status()
        yield c


def conversation(scenario: str, user: str = "Please help.") -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"You are a helpful agent. scenario:{scenario}"},
        {"role": "user", "content": user},
    ]


@dataclass
class Stream:
    """A client-side assembly of an SSE completion stream."""

    chunks: int = 0
    content: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    arg_deltas: dict[int, int] = field(default_factory=dict)
    finish_reason: str | None = None
    usage: dict[str, int] | None = None
    done: bool = False
    ids: set[str] = field(default_factory=set)

    def feed(self, line: str) -> None:
        if not line:
            return
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        if data == "[DONE]":
            self.done = True
            return
        self.chunks += 1
        payload = json.loads(data)
        self.ids.add(payload["id"])
        choice = payload["choices"][0]
        delta = choice["delta"]
        self.content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            call = self.calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                call["id"] = tc["id"]
                call["name"] = tc["function"]["name"]
            piece = tc.get("function", {}).get("arguments", "")
            if piece:
                call["arguments"] += piece
                self.arg_deltas[tc["index"]] = self.arg_deltas.get(tc["index"], 0) + 1
        if choice["finish_reason"] is not None:
            self.finish_reason = choice["finish_reason"]
            self.usage = payload.get("usage")

    def parsed_arguments(self, index: int) -> Any:
        return json.loads(self.calls[index]["arguments"])


def stream_completion(
    client: httpx.Client,
    messages: list[dict[str, Any]],
    headers: dict[str, str] | None = None,
    user: str | None = None,
) -> Stream:
    body: dict[str, Any] = {"model": "scripted", "stream": True, "messages": messages}
    if user:
        body["user"] = user
    out = Stream()
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"] == "text/event-stream"
        for line in response.iter_lines():
            out.feed(line)
    return out


def add_turn(messages: list[dict[str, Any]], s: Stream) -> None:
    calls = [
        {
            "id": c["id"],
            "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]},
        }
        for c in s.calls.values()
    ]
    messages.append({"role": "assistant", "content": s.content or None, "tool_calls": calls})
    for c in calls:
        messages.append({"role": "tool", "tool_call_id": c["id"], "content": '{"ok":true}'})


def test_streamed_tool_call_reassembles_only_after_the_final_chunk(client: httpx.Client) -> None:
    expected = json.loads((SCENARIOS / "multi_tool.json").read_text())["turns"][0]
    body = {"model": "m", "stream": True, "messages": conversation("multi_tool")}
    arguments = ""
    parseable_before_finish = []
    lines = []
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line:
                continue
            lines.append(line)
            if line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            for tc in choice["delta"].get("tool_calls", []):
                arguments += tc["function"].get("arguments", "")
            if choice["finish_reason"] is None and arguments:
                try:
                    json.loads(arguments)
                    parseable_before_finish.append(True)
                except json.JSONDecodeError:
                    parseable_before_finish.append(False)
    assert lines[-1] == "data: [DONE]"
    # the arguments are split: incomplete JSON on every chunk but the last argument piece
    assert len(parseable_before_finish) >= 3
    assert not any(parseable_before_finish[:-1])
    s = Stream()
    for line in lines:
        s.feed(line)
    assert s.done and s.finish_reason == "tool_calls"
    assert s.arg_deltas[0] >= 2
    assert s.calls[0]["name"] == "search_docs" and s.calls[0]["id"].startswith("call_")
    assert s.parsed_arguments(0) == expected["tool_calls"][0]["arguments"]
    assert s.content == expected["content"]
    assert s.usage is not None and s.usage["total_tokens"] > 0
    assert len(s.ids) == 1  # one generation, one id


def test_conversation_advances_turn_by_turn_to_the_final_answer(client: httpx.Client) -> None:
    messages = conversation("multi_tool")
    names = []
    for _ in range(10):
        s = stream_completion(client, messages)
        if s.finish_reason == "stop":
            break
        assert s.finish_reason == "tool_calls"
        names += [c["name"] for c in s.calls.values()]
        add_turn(messages, s)
    assert s.finish_reason == "stop" and not s.calls
    assert s.content.startswith("Done:")
    assert names == ["search_docs", "create_ticket", "update_record", "send_email", "search_docs"]


def test_same_request_gives_the_same_answer(client: httpx.Client) -> None:
    a = stream_completion(client, conversation("multi_tool"))
    b = stream_completion(client, conversation("multi_tool"))
    assert a.calls == b.calls and a.content == b.content
    assert a.ids != b.ids  # a retry is a new generation, never merged into the first


def test_loop_scenario_repeats_the_same_call_forever(client: httpx.Client) -> None:
    messages = conversation("loop_forever")
    seen = set()
    for _ in range(6):
        s = stream_completion(client, messages)
        assert s.finish_reason == "tool_calls"
        seen.add((s.calls[0]["name"], s.calls[0]["arguments"]))
        add_turn(messages, s)
    assert len(seen) == 1


def test_bench_scenario_has_ten_distinct_steps(client: httpx.Client) -> None:
    messages = conversation("bench_10")
    args = []
    while (s := stream_completion(client, messages)).finish_reason == "tool_calls":
        args.append(s.calls[0]["arguments"])
        add_turn(messages, s)
    assert len(args) == len(set(args)) == 10


def test_non_streaming_response(client: httpx.Client) -> None:
    body = {"model": "m", "messages": conversation("async_report")}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    call = choice["message"]["tool_calls"][0]
    assert call["function"]["name"] == "run_report"
    assert json.loads(call["function"]["arguments"])["report"] == "monthly_sales"
    assert r.json()["usage"]["total_tokens"] > 0


def test_default_and_unknown_scenarios(client: httpx.Client) -> None:
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.json()["choices"][0]["message"]["content"] == "Done."
    r = client.post("/v1/chat/completions", json={"messages": conversation("no_such_scenario")})
    assert r.status_code == 404


def test_scenario_can_be_posted_and_chosen_by_header(client: httpx.Client) -> None:
    scenario = {"name": "inline", "turns": [{"content": "inline answer"}]}
    assert client.post("/scenarios", json=scenario).status_code == 200
    body = {"messages": [{"role": "user", "content": "hi"}]}
    r = client.post("/v1/chat/completions", json=body, headers={"X-Scenario": "inline"})
    assert r.json()["choices"][0]["message"]["content"] == "inline answer"


# --- faults by header ------------------------------------------------------------------


def test_disconnect_mid_stream(client: httpx.Client) -> None:
    s = Stream()
    body = {"stream": True, "messages": conversation("multi_tool")}
    headers = {"X-Fault": "disconnect; after_chunks=4"}
    with (
        pytest.raises(httpx.RemoteProtocolError),
        client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            s.feed(line)
    assert s.chunks == 4 and s.finish_reason is None and not s.done


def test_incomplete_stream_ends_without_finish(client: httpx.Client) -> None:
    s = stream_completion(client, conversation("multi_tool"), {"X-Fault": "incomplete"})
    assert s.chunks == 2 and s.finish_reason is None and not s.done


@pytest.mark.parametrize("kind", ["length", "content_filter"])
def test_truncated_and_blocked_streams(client: httpx.Client, kind: str) -> None:
    s = stream_completion(client, conversation("multi_tool"), {"X-Fault": kind})
    assert s.finish_reason == kind and s.done
    for index in s.calls:  # whatever tool call arrived is not complete JSON
        with pytest.raises(json.JSONDecodeError):
            s.parsed_arguments(index)


def test_truncated_tool_call_never_completes(client: httpx.Client) -> None:
    messages = conversation("async_report")  # a turn with a tool call and no text
    s = stream_completion(client, messages, {"X-Fault": "length"})
    assert s.finish_reason == "length" and s.calls[0]["name"] == "run_report"
    with pytest.raises(json.JSONDecodeError):
        s.parsed_arguments(0)


def test_usage_chunk_when_requested(client: httpx.Client) -> None:
    body = {
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": conversation("multi_tool"),
    }
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        data = [json.loads(x[6:]) for x in r.iter_lines() if x and x != "data: [DONE]"]
    assert data[-2]["choices"][0]["finish_reason"] == "tool_calls" and "usage" not in data[-2]
    assert data[-1]["choices"] == [] and data[-1]["usage"]["total_tokens"] > 0


def test_slow_tokens(client: httpx.Client) -> None:
    started = time.monotonic()
    s = stream_completion(client, conversation("multi_tool"), {"X-Fault": "slow; delay_ms=20"})
    elapsed = time.monotonic() - started
    assert s.finish_reason == "tool_calls"
    assert elapsed >= 0.02 * s.chunks


def test_no_added_latency_by_default(client: httpx.Client) -> None:
    started = time.monotonic()
    for _ in range(20):
        stream_completion(client, conversation("multi_tool"))
    assert time.monotonic() - started < 2.0


def test_rate_limit_and_server_error(client: httpx.Client) -> None:
    body = {"stream": True, "messages": conversation("multi_tool")}
    r = client.post("/v1/chat/completions", json=body, headers={"X-Fault": "429; retry_after=2"})
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    r = client.post("/v1/chat/completions", json=body, headers={"X-Fault": "500"})
    assert r.status_code == 500
    stats = client.get("/stats").json()
    assert stats["faults"] == {"429": 1, "500": 1} and stats["faults_served"] == 2
    assert stats["requests"] == 2
    client.post("/reset")
    assert client.get("/stats").json()["requests"] == 0


# --- hostile faults by header -------------------------------------------------------------


def raw_stream(client: httpx.Client, fault: str) -> bytes:
    body = {"stream": True, "messages": conversation("multi_tool")}
    with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Fault": fault}
    ) as response:
        assert response.status_code == 200
        return response.read()


def data_lines(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


def test_keepalive_sends_comments_forever_after_the_first_chunks(client: httpx.Client) -> None:
    body = {"stream": True, "messages": conversation("multi_tool")}
    headers = {"X-Fault": "keepalive; delay_ms=5; after_chunks=2"}
    lines: list[str] = []
    with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            lines.append(line)
            if lines.count(": ping") == 20:
                break
    data = [line for line in lines if line.startswith("data:")]
    assert len(data) == 2 and "data: [DONE]" not in lines


def test_drip_sends_the_whole_stream_byte_by_byte(client: httpx.Client) -> None:
    dripped = data_lines(raw_stream(client, "drip; delay_ms=0.1"))
    client.post("/reset")
    normal = data_lines(raw_stream(client, ""))
    assert dripped == normal and dripped[-1] == b"[DONE]"


@pytest.mark.parametrize("shape", sorted(model_server.BAD_SHAPES))
def test_bad_chunk_sends_one_chunk_of_the_wrong_shape_then_finishes(
    client: httpx.Client, shape: str
) -> None:
    lines = data_lines(raw_stream(client, f"bad_chunk; shape={shape}; after_chunks=1; depth=50"))
    assert lines[-1] == b"[DONE]"
    bad = lines[1]
    if shape == "deep":
        assert bad == b"[" * 50 + b"]" * 50
    elif shape == "not_json":
        with pytest.raises(json.JSONDecodeError):
            json.loads(bad)
    else:
        payload = json.loads(bad)
        ids = (payload["id"], payload["model"]) if isinstance(payload, dict) else ("", "")
        assert payload == json.loads(model_server.bad_chunk(shape, *ids))
    assert all(isinstance(json.loads(line)["choices"], list) for line in lines[2:-1])


def test_bad_chunk_with_an_unknown_shape_is_refused(client: httpx.Client) -> None:
    body = {"stream": True, "messages": conversation("multi_tool")}
    headers = {"X-Fault": "bad_chunk; shape=nope"}
    assert client.post("/v1/chat/completions", json=body, headers=headers).status_code == 400


def test_huge_stream_huge_line_and_bad_utf8(client: httpx.Client) -> None:
    huge = data_lines(raw_stream(client, "huge_stream; size=20000"))
    content = "".join(
        json.loads(line)["choices"][0]["delta"].get("content") or "" for line in huge[1:-3]
    )
    assert len(content) >= 20_000 and huge[-1] == b"[DONE]"
    line = data_lines(raw_stream(client, "huge_line; size=50000"))
    assert len(json.loads(line[1])["choices"][0]["delta"]["content"]) == 50_000
    raw = raw_stream(client, "bad_utf8; after_chunks=1")
    bad = data_lines(raw)[1]
    assert b"\xff\xfe" in bad
    with pytest.raises(UnicodeDecodeError):
        bad.decode()


@pytest.mark.parametrize("value", ["inf", "1e300", "-1", "NaN", "garbage", "99999999999999999999"])
def test_retry_after_is_sent_verbatim(client: httpx.Client, value: str) -> None:
    body = {"stream": True, "messages": conversation("multi_tool")}
    r = client.post(
        "/v1/chat/completions", json=body, headers={"X-Fault": f"429; retry_after={value}"}
    )
    assert r.status_code == 429 and r.headers["retry-after"] == value
    rule = {"kind": "429", "retry_after": "Wed, 21 Oct 2015 07:28:00 GMT"}
    client.post("/faults", json=rule).raise_for_status()
    r = client.post("/v1/chat/completions", json=body)
    assert r.headers["retry-after"] == "Wed, 21 Oct 2015 07:28:00 GMT"


# --- faults by scenario turn and by rule: once per conversation -----------------------------


def test_scenario_faults_are_once_per_conversation(client: httpx.Client) -> None:
    body = {"stream": True, "messages": conversation("flaky_stream"), "user": "run-1"}
    first = client.post("/v1/chat/completions", json=body)
    assert first.status_code == 429 and first.headers["retry-after"] == "0.1"
    messages = conversation("flaky_stream")
    s = stream_completion(client, messages, user="run-1")  # the retry succeeds
    assert s.finish_reason == "tool_calls" and s.calls[0]["name"] == "search_docs"
    # another conversation gets its own fault
    other = client.post("/v1/chat/completions", json={**body, "user": "run-2"})
    assert other.status_code == 429
    add_turn(messages, s)
    with pytest.raises(httpx.RemoteProtocolError):  # turn 1 disconnects once ...
        stream_completion(client, messages, user="run-1")
    s = stream_completion(client, messages, user="run-1")  # ... and the retry is whole
    assert s.finish_reason == "tool_calls" and s.calls[0]["name"] == "create_ticket"
    assert s.parsed_arguments(0)["title"] == "Refund request"


def test_fault_rules_by_scenario_and_turn(client: httpx.Client) -> None:
    rule = {"kind": "500", "scenario": "multi_tool", "turn": 0, "per_conversation": True}
    assert client.post("/faults", json=rule).status_code == 200
    body = {"messages": conversation("multi_tool")}
    for user in ("a", "b"):
        assert client.post("/v1/chat/completions", json={**body, "user": user}).status_code == 500
        assert client.post("/v1/chat/completions", json={**body, "user": user}).status_code == 200
    other = {"messages": conversation("loop_forever")}
    assert client.post("/v1/chat/completions", json=other).status_code == 200
    assert client.delete("/faults").json() == {"rules": []}


def test_main_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentruns.connectors.testing.model_server", "--port", "0"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        url = banner.split(" on ", 1)[1].split()[0]
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
