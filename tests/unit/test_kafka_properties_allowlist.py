"""Kafka client properties are an allow-list: security settings and a few timeouts reach
librdkafka; what loads code, runs a command or is unknown is refused before any client is
built, and no properties file is taken from the working directory's ``.env``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from agentruns.connectors import settings as settings_module
from agentruns.connectors.errors import InvalidArgumentError
from agentruns.connectors.kafka_properties import KafkaPropertiesError, parse_properties
from agentruns.connectors.settings import load
from agentruns.streams import kafka_defaults
from agentruns.streams.kafka_defaults import use_client_properties


def refusal(text: str) -> str:
    with pytest.raises(KafkaPropertiesError) as caught:
        parse_properties(text.encode(), source="client.properties")
    line = caught.value.one_line()
    assert "\n" not in line
    return line


@pytest.mark.parametrize(
    "line",
    [
        "plugin.library.paths=/tmp/evil.so",
        "ssl.engine.location=/tmp/engine.so",
        "ssl.engine.id=evil",
        "ssl.providers=evil",
        "sasl.kerberos.kinit.cmd=touch /tmp/pwned",
        "sasl.oauthbearer.token.endpoint.url=http://attacker.example/token",
        "sasl.kerberos.principal=svc; touch /tmp/pwned",
        'sasl.kerberos.keytab=/etc/k.keytab" ; touch /tmp/pwned ; "',
        "debug=all",
        "interceptor.library=x",
        "oauthbearer_token_refresh_cb=x",
    ],
)
def test_what_loads_code_runs_commands_or_is_unknown_is_refused(line: str) -> None:
    key = line.split("=", 1)[0]
    message = refusal(f"security.protocol=SASL_SSL\n{line}\n")
    assert "line 2" in message and key in message


def test_the_security_settings_and_documented_timeouts_pass() -> None:
    text = (
        "security.protocol=SASL_SSL\n"
        "sasl.mechanism=OAUTHBEARER\n"
        "sasl.oauthbearer.method=oidc\n"
        "sasl.oauthbearer.client.id=svc\n"
        "sasl.oauthbearer.client.secret=s\n"
        "sasl.oauthbearer.token.endpoint.url=https://idp.example/token\n"
        "sasl.kerberos.principal=svc/host.example@EXAMPLE.COM\n"
        "sasl.kerberos.keytab=/etc/agentruns/svc.keytab\n"
        "ssl.ca.location=/etc/ssl/ca.pem\n"
        "ssl.endpoint.identification.algorithm=https\n"
        "client.id=agentruns\n"
        "socket.timeout.ms=30000\n"
        "socket.connection.setup.timeout.ms=10000\n"
        "reconnect.backoff.max.ms=5000\n"
    )
    parsed = parse_properties(text.encode(), source="client.properties")
    assert parsed["sasl.oauthbearer.token.endpoint.url"] == "https://idp.example/token"
    assert len(parsed) == 14


@pytest.fixture
def workdir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    import os

    for name in list(os.environ):
        if name.startswith("AGENTRUNS_"):
            monkeypatch.delenv(name)
    for name in ("AGENTRUNS_TOPIC_PREFIX", "AGENTRUNS_KAFKA_CONFIG"):
        monkeypatch.setenv(name, "")  # load() sets them: restored to absent afterwards
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    saved = dict(kafka_defaults._CLIENT_PROPERTIES)
    current = list(settings_module._CURRENT)
    yield tmp_path
    use_client_properties(saved)
    settings_module._CURRENT[:] = current


def test_a_properties_file_named_only_by_dotenv_is_refused(workdir: Path) -> None:
    (workdir / "client.properties").write_text("client.id=planted\n")
    (workdir / ".env").write_text("AGENTRUNS_KAFKA_CONFIG=client.properties\n")
    with pytest.raises(InvalidArgumentError) as caught:
        load()
    assert "AGENTRUNS_KAFKA_CONFIG" in caught.value.one_line()
    assert "client.id" not in kafka_defaults.client_properties()


def test_a_properties_file_named_in_the_environment_is_read(
    workdir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (workdir / "client.properties").write_text("client.id=named\n")
    monkeypatch.setenv("AGENTRUNS_KAFKA_CONFIG", str(workdir / "client.properties"))
    load()
    assert kafka_defaults.client_properties()["client.id"] == "named"
