"""Signed tenant headers: the per-tenant Kafka keys (HKDF under their own root), the signature
over tenant, record key and value, the processor's three modes, and hostile headers, each
refused with its reason while the next record is applied."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from msgspec.structs import replace

from agentruns.connectors.errors import AgentrunsError
from agentruns.connectors.keys import (
    Keys,
    main,
    main_kafka_key,
    processor_tenant_header,
    processor_tenant_keys,
    producer_tenant_key,
    tenant_header_root,
    tenant_kafka_key,
)
from agentruns.connectors.settings import Settings
from agentruns.processors.events import CancelRequested, RunSubmitted
from agentruns.streams import dlq
from agentruns.streams.codec import decode, encode
from agentruns.streams.inputs import Batch, Inbound, InputPath, PathSettings
from agentruns.streams.metrics import ProcessorStats
from agentruns.streams.records import input_record
from agentruns.streams.tenant_headers import (
    SIGNATURE_CHARS,
    SIGNATURE_HEADER,
    TENANT_HEADER,
    Header,
    TenantHeaderRefused,
    sign,
    signed_headers,
    signed_message,
    tenant_of_submission,
    verify,
)
from agentruns.streams.topics import TopicNames

SECRET = b"s" * 40
ROOT = tenant_header_root(SECRET)
SHOP = tenant_kafka_key(ROOT, "shop")
KEY, VALUE = b"run-1", b"the record's value"
AT = 1_700_000_000_000
TOPICS = TopicNames.for_prefix("t")


def key_of(tenant: str) -> bytes:
    return tenant_kafka_key(ROOT, tenant)


def signed(mode: Any = "signed", headers: list[Header] | None = None, **kw: Any) -> str:
    options: dict[str, Any] = {"named": None, "default": "upstream", "key_of": key_of}
    options.update(kw)
    return tenant_of_submission(mode, headers or [], KEY, VALUE, **options)


def refusal(headers: list[Header], **kw: Any) -> str:
    with pytest.raises(TenantHeaderRefused) as caught:
        signed(headers=headers, **kw)
    return str(caught.value)


# ------------------------------------------------------------------------------ keys


def test_each_tenant_has_its_own_key_under_a_root_that_is_no_other_key() -> None:
    keys = Keys.derive(SECRET)
    assert keys.tenant_headers == ROOT
    assert len({keys.console, keys.resume, keys.callback, ROOT, SECRET}) == 5
    assert len({SHOP, key_of("ops"), key_of("shop2"), ROOT}) == 4
    assert tenant_kafka_key(tenant_header_root(b"t" * 40), "shop") != SHOP


def test_the_processor_takes_the_root_never_needing_the_secret() -> None:
    from_root = processor_tenant_keys(ROOT.hex(), "")
    from_secret = processor_tenant_keys("", SECRET.decode())  # development
    assert from_root is not None and from_secret is not None
    assert from_root("shop") == from_secret("shop") == SHOP
    assert processor_tenant_keys("", "") is None
    for bad in ("abc", "zz" * 32, ROOT.hex() + "00"):
        with pytest.raises(AgentrunsError, match="AGENTRUNS_TENANT_HEADER_KEY"):
            processor_tenant_keys(bad, "")
    assert processor_tenant_header("trusted", "", "") == ("trusted", None)
    with pytest.raises(AgentrunsError, match="signed"):
        processor_tenant_header("signed", "", "")
    mode, keys = processor_tenant_header("signed", ROOT.hex(), "")
    assert mode == "signed" and keys is not None and keys("shop") == SHOP


def test_the_key_commands_print_the_root_and_a_tenants_key(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AGENTRUNS_TENANT_HEADER_KEY", raising=False)
    monkeypatch.setenv("AGENTRUNS_API_SECRET", SECRET.decode())
    assert main(["tenant-header"]) == 0
    assert capsys.readouterr().out.strip() == ROOT.hex()
    assert main_kafka_key(["--tenant", "shop"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == SHOP.hex()
    assert producer_tenant_key({"AGENTRUNS_TENANT_KAFKA_KEY": printed}) == SHOP
    assert producer_tenant_key({}) is None
    with pytest.raises(AgentrunsError, match="AGENTRUNS_TENANT_KAFKA_KEY"):
        producer_tenant_key({"AGENTRUNS_TENANT_KAFKA_KEY": "not hex"})
    with pytest.raises(AgentrunsError, match="tenant name"):
        main_kafka_key(["--tenant", "Not A Tenant"])
    # the processor's root is enough to hand out a tenant's key
    monkeypatch.delenv("AGENTRUNS_API_SECRET")
    monkeypatch.setenv("AGENTRUNS_TENANT_HEADER_KEY", ROOT.hex())
    assert main_kafka_key(["--tenant", "shop"]) == 0
    assert capsys.readouterr().out.strip() == SHOP.hex()
    monkeypatch.delenv("AGENTRUNS_TENANT_HEADER_KEY")
    with pytest.raises(AgentrunsError, match="AGENTRUNS_API_SECRET"):
        main_kafka_key(["--tenant", "shop"])


def test_the_mode_setting_keeps_the_older_boolean_working() -> None:
    def mode(**values: Any) -> str:
        return Settings.model_validate(values).tenant_header_mode()

    assert mode() == "default"
    assert mode(AGENTRUNS_TRUST_TENANT_HEADER=True) == "trusted"
    assert mode(AGENTRUNS_TENANT_HEADER="signed") == "signed"
    assert mode(AGENTRUNS_TENANT_HEADER="default", AGENTRUNS_TRUST_TENANT_HEADER=True) == "default"
    with pytest.raises(ValueError):
        mode(AGENTRUNS_TENANT_HEADER="sometimes")


# ------------------------------------------------------------------------ signatures


def test_a_signature_binds_tenant_record_key_and_value() -> None:
    signature = sign(SHOP, "shop", KEY, VALUE)
    assert len(signature) == SIGNATURE_CHARS
    verify(SHOP, "shop", signature, KEY, VALUE)
    verify(SHOP, "shop", signature.encode(), KEY, VALUE)
    for tenant, record_key, value, key in (
        ("shop", KEY, VALUE + b" ", SHOP),  # another record's value
        ("shop", b"run-2", VALUE, SHOP),  # another run
        ("ops", KEY, VALUE, key_of("ops")),  # another tenant, even with its own key
        ("shop", KEY, VALUE, key_of("ops")),  # another tenant's key
    ):
        with pytest.raises(TenantHeaderRefused, match="does not verify"):
            verify(key, tenant, signature, record_key, value)
    assert len({signed_message("a", b"b", b"c"), signed_message("a", b"bc", b"")}) == 2
    assert signed_message("shop", None, None) == signed_message("shop", b"", b"")
    with pytest.raises(ValueError):
        sign(SHOP, "Shop\n", KEY, VALUE)


def test_the_modes_take_the_header_as_configured() -> None:
    good = signed_headers(SHOP, "shop", KEY, VALUE)
    assert [name for name, _ in good] == [TENANT_HEADER, SIGNATURE_HEADER]
    # default: headers are not read at all, however hostile
    assert signed("default", [(TENANT_HEADER, b"\xff" * 999)]) == "upstream"
    assert signed("default", good, named="ops") == "ops"
    # trusted: the body's tenant, else the header's, unsigned
    assert signed("trusted", [(TENANT_HEADER, b"billing")]) == "billing"
    assert signed("trusted", [(TENANT_HEADER, b"billing")], named="ops") == "ops"
    assert signed("trusted") == "upstream"
    # signed: the header with its signature; no header: the default tenant
    assert signed("signed", good) == "shop"
    assert signed("signed", good, named="shop") == "shop"  # the API's: body and header agree
    assert signed("signed") == "upstream"
    assert signed("signed", named="upstream") == "upstream"


@pytest.mark.parametrize(
    ("headers", "named", "reason"),
    [
        ([(TENANT_HEADER, b"shop")], None, "tenant shop: no agentruns-tenant-signature"),
        ([(TENANT_HEADER, b"shop"), (SIGNATURE_HEADER, b"x" * 42)], None, "tenant shop: the"),
        ([(TENANT_HEADER, b"shop"), (SIGNATURE_HEADER, b"x" * 9000)], None, "9000 bytes"),
        ([(TENANT_HEADER, b"shop"), (SIGNATURE_HEADER, b"=" * 43)], None, "not a signature"),
        ([(TENANT_HEADER, b"shop"), (SIGNATURE_HEADER, "é" * 43)], None, "not a signature"),
        ([(TENANT_HEADER, b"shop"), (SIGNATURE_HEADER, None)], None, "has no value"),
        ([(TENANT_HEADER, b"s" * 64)], None, "64 bytes, at most 63"),
        ([(TENANT_HEADER, b"x" * 1_000_000)], None, "1000000 bytes"),
        ([(TENANT_HEADER, "shöp")], None, "not ASCII"),
        ([(TENANT_HEADER, b"sh\xffp")], None, "not ASCII"),
        ([(TENANT_HEADER, b"Shop")], None, "is not a tenant name"),
        ([(TENANT_HEADER, b"shop"), (TENANT_HEADER, b"ops")], None, "2 agentruns-tenant headers"),
        ([(SIGNATURE_HEADER, b"x" * 43)], None, "without agentruns-tenant"),
        ([], "ops", "tenant ops: the task names it without a signed"),
    ],
)
def test_a_hostile_tenant_header_is_refused_with_its_reason(
    headers: list[Header], named: str | None, reason: str
) -> None:
    assert reason in refusal(headers, named=named)


def test_a_signature_of_another_record_tenant_or_key_does_not_verify() -> None:
    def claim(tenant: str, signature: str) -> list[Header]:
        return [(TENANT_HEADER, tenant.encode()), (SIGNATURE_HEADER, signature.encode())]

    replayed = sign(SHOP, "shop", b"run-0", b"an earlier task of shop")
    reason = refusal(claim("shop", replayed))
    assert "tenant shop" in reason and "signature" in reason
    # shop's producer signs for ops with its own key: ops's key is another
    assert "tenant ops" in refusal(claim("ops", sign(SHOP, "ops", KEY, VALUE)))
    # a valid signed header of shop on a body that names ops
    assert "the signed agentruns-tenant header says shop" in refusal(
        signed_headers(SHOP, "shop", KEY, VALUE), named="ops"
    )
    several = [*signed_headers(SHOP, "shop", KEY, VALUE), (SIGNATURE_HEADER, b"y" * 43)]
    assert "2 agentruns-tenant-signature headers" in refusal(several)


# --------------------------------------------------------------------- the input path


def _submit(run_id: str) -> RunSubmitted:
    return RunSubmitted(run_id=run_id, event_id=f"{run_id}:submit", at=AT, trace_id="t", goal="g")


def _record(event: RunSubmitted, offset: int, sign_as: tuple[bytes, str] | None) -> Inbound:
    value = encode("Input", input_record(event))
    key = event.run_id.encode()
    headers = [] if sign_as is None else signed_headers(sign_as[0], sign_as[1], key, value)
    return Inbound("t.inbox", 0, offset, key, value, headers, AT)


def test_the_processor_applies_signed_tasks_and_dead_letters_each_forged_one() -> None:
    path = InputPath(
        TOPICS,
        PathSettings(default_tenant="upstream", tenant_header="signed", tenant_key=key_of),
        ProcessorStats(),
        clock=lambda: AT / 1000,
    )
    replayed = _record(_submit("r0"), 0, (SHOP, "shop"))

    def with_headers(run_id: str, offset: int, headers: list[Header]) -> Inbound:
        return dataclasses.replace(_record(_submit(run_id), offset, None), headers=headers)

    sig_of_r0 = replayed.headers[1]
    hostile = [
        ("forged", _record(_submit("bad1"), 1, (key_of("ops"), "shop"))),
        ("replayed", with_headers("bad2", 2, [(TENANT_HEADER, b"shop"), sig_of_r0])),
        ("unsigned", with_headers("bad3", 3, [(TENANT_HEADER, b"shop")])),
        ("short", with_headers("bad4", 4, [(TENANT_HEADER, b"shop"), (SIGNATURE_HEADER, b"a")])),
        ("long", with_headers("bad5", 5, [(TENANT_HEADER, b"shop" * 100)])),
        ("ascii", with_headers("bad6", 6, [(TENANT_HEADER, "shöp".encode())])),
        ("twice", with_headers("bad7", 7, [(TENANT_HEADER, b"ops"), (TENANT_HEADER, b"shop")])),
    ]
    batch = Batch()
    path.handle(replayed, batch)
    assert path.slots[0]["r0"].state.tenant == "shop"  # type: ignore[union-attr]
    offset = 10
    for what, record in hostile:
        batch = Batch()
        path.handle(record, batch)
        (dead,) = [r for t, _, r, _, _ in batch.records if t == TOPICS.dlq]
        letter = decode(dead, "DeadLetter").record
        assert letter["error_class"] == dlq.INVALID_EVENT, what
        assert letter["reason"].startswith("invalid_input:tenant: "), what
        if what in ("forged", "replayed", "unsigned", "short"):
            assert "tenant shop" in letter["reason"] and "signature" in letter["reason"], what
        run_id = record.key.decode()  # type: ignore[union-attr]
        assert run_id not in path.slots.get(0, {}), what
        # the next record is applied: a signed one in its tenant, an unsigned one in the default
        offset += 1
        batch = Batch()
        path.handle(_record(_submit(f"next-{what}"), offset, (key_of("ops"), "ops")), batch)
        assert path.slots[0][f"next-{what}"].state.tenant == "ops", what  # type: ignore[union-attr]
    plain = _record(replace(_submit("plain"), goal="g2"), offset + 1, None)
    path.handle(plain, Batch())
    assert path.slots[0]["plain"].state.tenant == "upstream"  # type: ignore[union-attr]


def test_a_held_submission_never_takes_the_tenant_header_of_the_record_that_releases_it() -> None:
    """A submission that waits for its producer's earlier input has no headers of its own
    kept; the signed header of the input that fills the gap is that input's, not its."""
    path = InputPath(
        TOPICS,
        PathSettings(default_tenant="upstream", tenant_header="signed", tenant_key=key_of),
        ProcessorStats(),
        clock=lambda: AT / 1000,
    )

    def numbered(event: Any, seq: int, offset: int) -> Inbound:
        value = encode("Input", input_record(event, producer_id="p", producer_seq=seq))
        key = event.run_id.encode()
        headers = signed_headers(key_of("ops"), "ops", key, value)  # valid, for this record
        return Inbound("t.inbox", 0, offset, key, value, headers, AT)

    held = numbered(_submit("h1"), 2, 0)
    first = numbered(CancelRequested(run_id="h1", event_id="c1", at=AT, trace_id="t"), 1, 1)
    path.handle(held, Batch())
    assert path.slots[0]["h1"].state is None  # held for input 1
    path.handle(first, Batch())
    state = path.slots[0]["h1"].state
    assert state is not None and state.tenant == "upstream"


def test_a_producer_takes_a_tenant_only_with_its_key() -> None:
    from agentruns.connectors.api.client import RunsProducer

    for tenant, key in (("shop", None), (None, SHOP), ("shop", b""), ("Not A Tenant", SHOP)):
        with pytest.raises(ValueError):
            RunsProducer(
                "127.0.0.1:9", producer_id="p", partitions=1, tenant=tenant, tenant_key=key
            )
