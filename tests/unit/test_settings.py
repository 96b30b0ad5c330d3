"""The Kafka client properties file (hostile input included) and where settings come from:
a flag over the environment over ``.env`` over the default."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentruns.connectors import settings as settings_module
from agentruns.connectors.kafka_properties import (
    MAX_BYTES,
    KafkaPropertiesError,
    check_with_librdkafka,
    parse_properties,
    read_properties_file,
)
from agentruns.connectors.settings import (
    KAFKA_CONFIG_ENV,
    Settings,
    load,
    settings_table,
    take_kafka_config_flag,
)
from agentruns.streams import kafka_defaults
from agentruns.streams.kafka_defaults import client_settings, use_client_properties

CONFIGURATION = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def parse(text: str) -> dict[str, str]:
    return parse_properties(text.encode(), source="client.properties")


def refusal(data: bytes) -> str:
    with pytest.raises(KafkaPropertiesError) as caught:
        parse_properties(data, source="client.properties")
    line = caught.value.one_line()
    assert "\n" not in line
    return line


def test_comments_blank_lines_separators_and_whitespace() -> None:
    text = (
        "# a comment\n"
        "! another\n"
        "\n"
        "   security.protocol = SASL_SSL\n"
        "sasl.mechanisms:PLAIN\n"
        "sasl.username=  svc \n"
        "ssl.ca.location=/etc/ssl/ca.pem\r\n"
    )
    assert parse(text) == {
        "security.protocol": "SASL_SSL",
        "sasl.mechanisms": "PLAIN",
        "sasl.username": "svc ",
        "ssl.ca.location": "/etc/ssl/ca.pem",
    }


def test_escapes_and_continuation_lines() -> None:
    text = "sasl.password=a\\=b\\:c\\\\d\\u00e9\\t!\nclient.id=one,\\\n    two\nssl.a\\=key=x\n"
    assert parse(text) == {
        "sasl.password": "a=b:c\\dé\t!",
        "client.id": "one,two",
        "ssl.a=key": "x",
    }


def test_jaas_config_becomes_username_and_password() -> None:
    text = (
        "sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule required "
        'username="svc" password="p=w;d";\n'
    )
    assert parse(text) == {"sasl.username": "svc", "sasl.password": "p=w;d"}


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"security.protocol=SSL\nnot a property\n", "line 2: no '='"),
        (b"a=1\nb=2\na=3\n", "line 3: a is set twice (first on line 1)"),
        (b"=value\n", "line 1: a property without a key"),
        (b"ok=1\n\xff\xfe=2\n", "line 2: not UTF-8"),
        (b"a=1\0\n", "NUL bytes"),
        (b"x" * (MAX_BYTES + 1), f"larger than {MAX_BYTES} bytes"),
        (b"k=\\u12\n", "line 1: a \\u escape needs four hex digits"),
        (b"bootstrap.servers=b:9092\n", "bootstrap.servers cannot be set here"),
        (b"group.id=mine\n", "group.id cannot be set here"),
        (
            b"sasl.jaas.config=org.apache.kafka.common.security.oauthbearer."
            b"OAuthBearerLoginModule required;\n",
            "PLAIN and SCRAM login modules only",
        ),
        (
            b"sasl.jaas.config=org.apache.kafka.common.security.plain.PlainLoginModule "
            b'required username="u";\n',
            "needs username and password",
        ),
    ],
)
def test_hostile_files_are_refused_in_one_line(data: bytes, expected: str) -> None:
    assert expected in refusal(data)


def test_a_huge_file_is_not_read_whole(tmp_path: Path) -> None:
    path = tmp_path / "huge.properties"
    with path.open("wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte of NULs that never reaches memory
    with pytest.raises(KafkaPropertiesError, match="larger than"):
        read_properties_file(path)


def test_a_missing_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(KafkaPropertiesError, match="cannot read it"):
        read_properties_file(tmp_path / "absent.properties")


def test_librdkafka_refusal_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text("security.protocol=SASL_PLAINTEXT\n# x\nssl.no.such.thing=1\n")
    with pytest.raises(KafkaPropertiesError) as caught:
        check_with_librdkafka(read_properties_file(path), str(path))
    assert f"{path} line 3: librdkafka refuses it" in caught.value.one_line()
    assert "ssl.no.such.thing" in caught.value.one_line()


def test_a_bad_value_is_refused_by_librdkafka(tmp_path: Path) -> None:
    path = tmp_path / "client.properties"
    path.write_text("security.protocol=CARRIER_PIGEON\n")
    with pytest.raises(KafkaPropertiesError, match="line 1: librdkafka refuses it"):
        check_with_librdkafka(read_properties_file(path), str(path))


@pytest.fixture
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No AGENTRUNS_* variable from outside, the working directory empty; the process-wide
    client properties restored afterwards."""
    import os

    for name in list(os.environ):
        if name.startswith("AGENTRUNS_") or name in ("KAFKA_BOOTSTRAP_SERVERS", "DATABASE_URL"):
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


def test_precedence_flag_over_env_over_dotenv_over_default(
    clean: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert Settings().topic_prefix == "agentruns"
    (clean / ".env").write_text("AGENTRUNS_TOPIC_PREFIX=from-dotenv\nAGENTRUNS_API_PORT=9000\n")
    assert Settings().topic_prefix == "from-dotenv"
    assert Settings().api_port == 9000
    monkeypatch.setenv("AGENTRUNS_TOPIC_PREFIX", "from-env")
    assert Settings().topic_prefix == "from-env"
    assert Settings().api_port == 9000
    assert Settings(topic_prefix="from-flag").topic_prefix == "from-flag"


def test_kafka_config_reaches_every_client_and_child_processes(
    clean: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = clean / "client.properties"
    path.write_text(
        "security.protocol=SASL_PLAINTEXT\nsasl.mechanisms=PLAIN\n"
        "sasl.username=u\nsasl.password=p\n"
    )
    words, flag = take_kafka_config_flag(["--kafka-config", str(path), "processor", "-x"])
    assert (words, flag) == (["processor", "-x"], path)
    load({"kafka_config": flag})
    assert client_settings()["security.protocol"] == "SASL_PLAINTEXT"
    import os

    assert os.environ["AGENTRUNS_KAFKA_CONFIG"] == str(path.resolve())
    monkeypatch.delenv("AGENTRUNS_KAFKA_CONFIG")
    load()
    assert "security.protocol" not in client_settings()


def test_a_command_leaves_the_process_as_it_was(clean: Path) -> None:
    """run_command loads the settings for one command (settings.loaded), so commands run
    in-process one after another do not see each other's."""
    import os

    from agentruns.connectors.lifecycle import run_command

    path = clean / "client.properties"
    path.write_text("client.id=seen-by-the-command\n")
    seen: list[object] = []

    def command(words: list[str]) -> int:
        seen.append((words, client_settings().get("client.id"), os.environ[KAFKA_CONFIG_ENV]))
        return 0

    assert run_command(command, ["--kafka-config", str(path), "go"]) == 0
    assert seen == [(["go"], "seen-by-the-command", str(path.resolve()))]
    assert "client.id" not in client_settings()
    assert KAFKA_CONFIG_ENV not in os.environ
    assert settings_module._CURRENT == [] or settings_module._CURRENT[0].kafka_config is None


def test_a_bad_properties_file_ends_the_command_in_one_line(
    clean: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from agentruns.connectors.lifecycle import run_command

    path = clean / "client.properties"
    path.write_text("security.protocol=SASL_SSL\nsasl.username\n")
    assert run_command(lambda words: 0, ["--kafka-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"{path} line 2: no '=' between key and value" in err


def test_flag_forms() -> None:
    assert take_kafka_config_flag(["a", "--kafka-config=f.properties"]) == (
        ["a"],
        Path("f.properties"),
    )
    assert take_kafka_config_flag(["a", "--", "--kafka-config", "x"]) == (
        ["a", "--", "--kafka-config", "x"],
        None,
    )


def test_a_bad_setting_is_one_line(clean: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from agentruns.connectors.errors import InvalidArgumentError

    monkeypatch.setenv("AGENTRUNS_API_PORT", "eighty")
    with pytest.raises(InvalidArgumentError, match="AGENTRUNS_API_PORT"):
        load()


def test_metrics_address_is_a_setting(clean: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTRUNS_METRICS_ADDRESS", "0.0.0.0:9400")
    assert Settings().metrics_address == "0.0.0.0:9400"


def test_readme_lists_every_setting() -> None:
    assert settings_table() in CONFIGURATION.read_text()
