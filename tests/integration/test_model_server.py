"""The scripted model server over real loopback HTTP (no broker needed)."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentruns.connectors.dev.servers import model_server
from agentruns.connectors.dev.servers.httpserver import ServerHandle

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


# --- latency: a drawn time per call, paced like a real model ------------------------------

FIXED = "latency; sigma=0; median_ms="  # sigma 0: every call takes exactly the median


def timed_stream(
    client: httpx.Client, fault: str, user: str = "run-l", scenario: str = "multi_tool"
) -> tuple[Stream, float, float]:
    """The assembled stream, the seconds to its first chunk and to its end."""
    body = {"stream": True, "messages": conversation(scenario), "user": user}
    out, first = Stream(), 0.0
    started = time.monotonic()
    with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Fault": fault}
    ) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            first = first or time.monotonic() - started
            out.feed(line)
    return out, first, time.monotonic() - started


def test_latency_stream_takes_the_drawn_time_with_filler_first(client: httpx.Client) -> None:
    plain = stream_completion(client, conversation("multi_tool"), user="run-l")
    s, first, total = timed_stream(client, FIXED + "500; chunk_ms=10")
    assert first >= 0.1  # the first token after ttft_share (0.2) of L
    assert 0.5 <= total < 0.5 + 3.0
    # about (L - ttft) / chunk_ms = 40 deltas after the role delta; then the finish chunk
    assert 36 <= s.chunks - 2 <= 44
    assert s.done and s.finish_reason == "tool_calls"
    assert s.content.endswith(plain.content) and len(s.content) > len(plain.content)
    assert s.calls == plain.calls  # the scripted deltas come last, whole
    assert s.usage is not None and plain.usage is not None
    assert s.usage["completion_tokens"] > plain.usage["completion_tokens"]  # filler counts


def test_latency_without_filler_spreads_the_scripted_deltas(client: httpx.Client) -> None:
    plain = stream_completion(client, conversation("multi_tool"), user="run-l")
    s, _, total = timed_stream(client, FIXED + "300; chunk_ms=0; ttft_share=0")
    assert 0.3 <= total < 0.3 + 3.0
    assert s.chunks == plain.chunks and s.content == plain.content and s.calls == plain.calls
    assert s.usage == plain.usage


def test_latency_non_streamed_waits_then_answers_the_script(client: httpx.Client) -> None:
    body = {"messages": conversation("multi_tool"), "user": "run-n"}
    plain = client.post("/v1/chat/completions", json=body).json()
    started = time.monotonic()
    r = client.post("/v1/chat/completions", json=body, headers={"X-Fault": FIXED + "300"})
    assert 0.3 <= time.monotonic() - started < 0.3 + 3.0
    assert r.json()["choices"] == plain["choices"]  # no filler without a stream


def test_latency_tool_call_is_assembled_by_the_openai_client(server: ServerHandle) -> None:
    openai = pytest.importorskip("openai")
    calls = []
    for fault in ("", FIXED + "300; chunk_ms=10"):
        with (
            openai.OpenAI(
                base_url=f"{server.url}/v1", api_key="none", default_headers={"X-Fault": fault}
            ) as ai,
            ai.chat.completions.stream(
                model="scenario:multi_tool", messages=conversation("multi_tool"), user="run-o"
            ) as stream,
        ):
            completion = stream.get_final_completion()
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "tool_calls"
        calls.append([(c.id, c.function.name, c.function.arguments) for c in message.tool_calls])
    assert calls[0] == calls[1]
    assert calls[1][0][1] == "search_docs"
    assert json.loads(calls[1][0][2]) == {"query": "escalation policy", "limit": 3}


def test_latency_is_accounted_per_conversation_and_reset(client: httpx.Client) -> None:
    for user in ("run-a", "run-a", "run-b"):
        timed_stream(client, FIXED + "100; chunk_ms=0", user=user)
    timed_stream(client, "", user="run-c")  # no latency: not accounted
    seen = client.get("/latency").json()["conversations"]
    assert {k: (v["calls"], v["ms"]) for k, v in seen.items()} == {
        "run-a": (2, 200.0),
        "run-b": (1, 100.0),
    }
    # how long serving them really took: at least what was planned
    assert seen["run-a"]["served_ms"] >= 200.0 and seen["run-b"]["served_ms"] >= 100.0
    client.post("/reset")
    assert client.get("/latency").json() == {"conversations": {}}


def test_latency_draw_is_deterministic_per_seed_conversation_turn_and_attempt(
    client: httpx.Client,
) -> None:
    fault = "latency; median_ms=200; sigma=0.5; min_ms=50; max_ms=1000; chunk_ms=0"
    for user in ("run-x", "run-x", "run-y"):
        timed_stream(client, fault, user=user)
    timed_stream(client, fault + "; seed=7", user="run-z")
    params = model_server.StreamLatency(median_ms=200, sigma=0.5, min_ms=50, max_ms=1000)
    expected = {
        "run-x": params.draw_ms("run-x", 0, 0) + params.draw_ms("run-x", 0, 1),
        "run-y": params.draw_ms("run-y", 0, 0),
        "run-z": params.model_copy(update={"seed": 7}).draw_ms("run-z", 0, 0),
    }
    seen = client.get("/latency").json()["conversations"]
    assert {k: v["ms"] for k, v in seen.items()} == pytest.approx(expected, abs=0.001)
    assert len({round(v, 3) for v in expected.values()}) == 3


def test_latency_by_rule_and_by_scenario_turn(client: httpx.Client) -> None:
    rule = {"kind": "latency", "times": None, "scenario": "loop_forever", "median_ms": 200}
    assert client.post("/faults", json={**rule, "sigma": 0}).status_code == 200
    _, _, total = timed_stream(client, "", user="run-r", scenario="loop_forever")
    assert total >= 0.2
    timed_stream(client, "", user="run-r", scenario="multi_tool")  # another scenario: none
    scenario = {
        "name": "slow_model",
        "turns": [{"content": "ok", "fault": {"kind": "latency", "times": None, "median_ms": 150}}],
    }
    assert client.post("/scenarios", json=scenario).status_code == 200
    _, _, total = timed_stream(client, "", user="run-s", scenario="slow_model")
    assert total >= 0.1  # clamped to min_ms at the least
    seen = client.get("/latency").json()["conversations"]
    assert (seen["run-r"]["calls"], seen["run-r"]["ms"]) == (1, 200.0)
    assert seen["run-s"]["calls"] == 1


def test_latency_pace_is_bounded() -> None:
    """A ten-minute L at 1 ms a chunk streams at most MAX_FILLER_CHUNKS chunks, wider apart."""
    spec = model_server.StreamLatency(chunk_ms=1)
    pace = model_server.Pace(600.0, spec)
    assert pace.filler(5) == model_server.MAX_FILLER_CHUNKS - 5
    assert model_server.Pace(0.3, spec.model_copy(update={"chunk_ms": 0})).filler(5) == 0
    due = pace.offsets(frames=4, deltas=2)
    assert due == [120.0, 360.0, 600.0, 600.0]


@pytest.mark.parametrize(
    "params",
    [
        {"median_ms": -1},
        {"median_ms": 1e12},
        {"sigma": 1e9},
        {"chunk_ms": -5},
        {"chunk_ms": 0.001},
        {"ttft_share": 2},
        {"min_ms": 500, "max_ms": 100},
        {"max_ms": 50},  # below the default min_ms (100)
        {"median_ms": "NaN"},
    ],
)
def test_hostile_latency_parameters_are_refused(
    client: httpx.Client, params: dict[str, Any]
) -> None:
    r = client.post("/faults", json={"kind": "latency", "times": None, **params})
    assert r.status_code == 422, r.text
    assert client.get("/faults").json() == {"rules": []}
    scenario = {"name": "bad", "turns": [{"fault": {"kind": "latency", **params}}]}
    assert client.post("/scenarios", json=scenario).status_code == 422
    header = "latency; " + "; ".join(f"{k}={v}" for k, v in params.items())
    body = {"stream": True, "messages": conversation("multi_tool")}
    r = client.post("/v1/chat/completions", json=body, headers={"X-Fault": header})
    assert r.status_code == 400, r.text


def test_closing_the_server_ends_sleeping_latency_streams() -> None:
    handle = model_server.serve("127.0.0.1", 0)
    outcome: list[BaseException | None] = []

    def slow_call() -> None:
        body = {"stream": True, "messages": conversation("multi_tool")}
        fault = {"X-Fault": FIXED + "60000; max_ms=60000"}
        try:
            with (
                httpx.Client(base_url=handle.url, timeout=30.0) as c,
                c.stream("POST", "/v1/chat/completions", json=body, headers=fault) as r,
            ):
                r.read()
            outcome.append(None)
        except httpx.HTTPError as exc:
            outcome.append(exc)

    thread = threading.Thread(target=slow_call)
    thread.start()
    deadline = time.monotonic() + 5
    while not httpx.get(f"{handle.url}/latency").json()["conversations"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    started = time.monotonic()
    handle.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and time.monotonic() - started < 5.0
    assert outcome and outcome[0] is not None  # cut off, not answered


def test_many_concurrent_latency_streams_overlap(server: ServerHandle) -> None:
    """200 streams of 500 ms each: together about as long as one, far below one after another."""
    httpx.post(f"{server.url}/reset")
    body = json.dumps(
        {"stream": True, "messages": conversation("multi_tool"), "model": "m"}
    ).encode()

    def one(i: int) -> bytes:
        conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
        try:
            headers = {
                "Content-Type": "application/json",
                "X-Fault": FIXED + "500; chunk_ms=50",
                "X-Conversation-Key": f"run-{i}",
            }
            conn.request("POST", "/v1/chat/completions", body=body, headers=headers)
            response = conn.getresponse()
            assert response.status == 200
            return response.read()
        finally:
            conn.close()

    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=200) as pool:
        bodies = list(pool.map(one, range(200)))
    elapsed = time.monotonic() - started
    assert all(b.rstrip().endswith(b"data: [DONE]") for b in bodies)
    assert 0.5 <= elapsed < 10.0
    assert len(httpx.get(f"{server.url}/latency").json()["conversations"]) == 200


def test_main_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentruns.connectors.dev.servers.model_server", "--port", "0"],
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
