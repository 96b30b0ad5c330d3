"""Kafka client properties files: Kafka's own ``key=value`` Java-properties format (what the
Kafka tools take as ``--command-config``), read into the librdkafka settings every client of
the process gets.

The file is read strictly: it must be small UTF-8 text, every property line has a ``=`` or
``:`` between key and value, a key appears once, and anything wrong is one error naming the
line. Java-only settings with a librdkafka equivalent are translated (``sasl.jaas.config`` of
the PLAIN and SCRAM login modules becomes ``sasl.username``/``sasl.password``); settings
librdkafka does not know are left for librdkafka to refuse (:func:`check_with_librdkafka`).

Keys are an allow-list (:data:`ALLOWED`, :data:`ALLOWED_PREFIXES`): the security settings
and a few connection timeouts. librdkafka can load shared libraries (``plugin.library.paths``,
an OpenSSL engine or provider) and run a shell command (``sasl.kerberos.kinit.cmd``, with the
principal and keytab pasted into it); a properties file is configuration, never code, so those
keys are refused, the Kerberos names are held to plain characters, and an OIDC token endpoint
(which receives the client secret) must be https.
"""

from __future__ import annotations

import re
from pathlib import Path

from agentruns.connectors.errors import AgentrunsError

#: Larger than any real client configuration; a file beyond it is not one.
MAX_BYTES = 64 << 10

#: Settings agentruns sets itself for each client: a file that sets them would break the
#: processing guarantees (group ids, transactional ids) or be silently ignored.
RESERVED = {
    "bootstrap.servers": "set KAFKA_BOOTSTRAP_SERVERS (or --bootstrap) instead",
    "group.id": "agentruns names its consumer groups itself",
    "transactional.id": "agentruns names its transactional producers itself",
    "enable.idempotence": "agentruns sets it per producer",
    "isolation.level": "agentruns reads committed records only",
    "enable.auto.commit": "agentruns commits offsets itself",
    "logger": "agentruns routes librdkafka's log lines itself",
}

#: Keys a properties file may set besides those under ALLOWED_PREFIXES.
ALLOWED = frozenset(
    {
        "security.protocol",
        "client.id",
        "socket.timeout.ms",
        "socket.connection.setup.timeout.ms",
        "socket.keepalive.enable",
        "connections.max.idle.ms",
        "metadata.max.age.ms",
        "reconnect.backoff.ms",
        "reconnect.backoff.max.ms",
        "retry.backoff.ms",
        "retry.backoff.max.ms",
    }
)
ALLOWED_PREFIXES = ("sasl.", "ssl.")

#: Keys under ALLOWED_PREFIXES that load code or run a command.
REFUSED = {
    "ssl.engine.location": "it loads a shared library (an OpenSSL engine)",
    "ssl.engine.id": "it selects an OpenSSL engine, which loads code",
    "ssl.providers": "it loads OpenSSL providers (shared libraries)",
    "sasl.kerberos.kinit.cmd": "it is a shell command librdkafka runs",
}

#: Values librdkafka pastes into its kinit shell command: plain names and paths only.
_SHELL_SAFE = re.compile(r"^[A-Za-z0-9._/@+:=,-]*$")
_KINIT_ARGUMENTS = ("sasl.kerberos.principal", "sasl.kerberos.keytab")
_TOKEN_ENDPOINT = "sasl.oauthbearer.token.endpoint.url"

_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}
_JAAS = re.compile(
    r"^\s*(?P<module>[\w.$]+)\s+(?P<flag>required|requisite|sufficient|optional)"
    r"(?P<options>(?:\s+[\w.-]+\s*=\s*(?:\"(?:[^\"\\]|\\.)*\"|[^\s;\"]+))*)\s*;?\s*$"
)
_JAAS_OPTION = re.compile(r"([\w.-]+)\s*=\s*(\"(?:[^\"\\]|\\.)*\"|[^\s;\"]+)")
_PASSWORD_MODULES = (
    "org.apache.kafka.common.security.plain.PlainLoginModule",
    "org.apache.kafka.common.security.scram.ScramLoginModule",
)


class KafkaPropertiesError(AgentrunsError):
    """A Kafka client properties file that cannot be used."""


def _fail(
    source: str, line: int | None, text: str, hint: str | None = None
) -> KafkaPropertiesError:
    where = f"{source} line {line}" if line is not None else source
    return KafkaPropertiesError(f"Kafka client properties {where}: {text}", hint=hint)


def read_properties_file(path: Path) -> dict[str, str]:
    """The librdkafka settings of the properties file at ``path``."""
    source = str(path)
    try:
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise _fail(source, None, f"cannot read it ({exc.strerror or exc})") from exc
    return parse_properties(data, source=source)


def parse_properties(data: bytes, *, source: str = "<properties>") -> dict[str, str]:
    """Parse ``data`` (a properties file's bytes) into librdkafka settings."""
    if len(data) > MAX_BYTES:
        raise _fail(source, None, f"larger than {MAX_BYTES} bytes: not a client configuration")
    if b"\0" in data:
        raise _fail(source, None, "holds NUL bytes: not a text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise _fail(source, line, "not UTF-8 text") from exc
    raw: dict[str, tuple[str, int]] = {}
    for number, logical in _logical_lines(text):
        key, value = _split(logical, source, number)
        if key in raw:
            raise _fail(source, number, f"{key} is set twice (first on line {raw[key][1]})")
        raw[key] = (value, number)
    return _translate(raw, source)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each property line: comments and blank lines dropped,
    continuation lines (a line ending in an odd number of backslashes) joined."""
    out: list[tuple[int, str]] = []
    pending: str | None = None
    start = 0
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip(" \t\f")
        if pending is None:
            if not stripped or stripped[0] in "#!":
                continue
            start, pending = number, ""
        pending += stripped
        trailing = len(pending) - len(pending.rstrip("\\"))
        if trailing % 2 == 1:
            pending = pending[:-1]
            continue
        out.append((start, pending))
        pending = None
    if pending is not None:
        out.append((start, pending))
    return out


def _split(line: str, source: str, number: int) -> tuple[str, str]:
    """A logical line's key and value, unescaped; the first unescaped ``=`` or ``:`` divides
    them."""
    i = 0
    while i < len(line):
        char = line[i]
        if char == "\\":
            i += 2
            continue
        if char in "=:":
            key = _unescape(line[:i].rstrip(" \t\f"), source, number)
            value = _unescape(line[i + 1 :].lstrip(" \t\f"), source, number)
            if not key:
                raise _fail(source, number, "a property without a key")
            return key, value
        i += 1
    raise _fail(source, number, "no '=' between key and value", hint="write key=value")


def _unescape(text: str, source: str, number: int) -> str:
    out: list[str] = []
    i = 0
    while i < len(text):
        char = text[i]
        if char != "\\" or i + 1 == len(text):
            out.append(char)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "u":
            digits = text[i + 2 : i + 6]
            if len(digits) != 4 or not all(c in "0123456789abcdefABCDEF" for c in digits):
                raise _fail(source, number, "a \\u escape needs four hex digits")
            out.append(chr(int(digits, 16)))
            i += 6
            continue
        out.append(_ESCAPES.get(nxt, nxt))
        i += 2
    return "".join(out)


def _translate(raw: dict[str, tuple[str, int]], source: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, (value, number) in raw.items():
        if key in RESERVED:
            raise _fail(source, number, f"{key} cannot be set here", hint=RESERVED[key])
        _check_allowed(key, value, source, number)
        if key == "sasl.jaas.config":
            for name, credential in _jaas_credentials(value, source, number).items():
                if name in raw:
                    raise _fail(source, number, f"sasl.jaas.config and {name} both set")
                out[name] = credential
            continue
        out[key] = value
    return out


def _check_allowed(key: str, value: str, source: str, number: int) -> None:
    """Refuse a key off the allow-list, one that loads code or runs a command, and a value
    that would reach a shell or send a secret in clear."""
    if key in REFUSED:
        raise _fail(source, number, f"{key} is refused: {REFUSED[key]}")
    if key not in ALLOWED and key != "sasl.jaas.config" and not key.startswith(ALLOWED_PREFIXES):
        raise _fail(
            source,
            number,
            f"{key} is not a setting agentruns passes on",
            hint="security.protocol, sasl.*, ssl.*, client.id and the socket, reconnect and "
            "retry timeouts are (docs/configuration.md)",
        )
    if key in _KINIT_ARGUMENTS and not _SHELL_SAFE.match(value):
        raise _fail(
            source,
            number,
            f"{key} holds characters a shell would read (librdkafka pastes it into kinit)",
            hint="letters, digits and ._/@+:=,- only",
        )
    if key == _TOKEN_ENDPOINT and not value.lower().startswith("https://"):
        raise _fail(
            source, number, f"{key} must be an https:// URL (it receives the client secret)"
        )


def _jaas_credentials(value: str, source: str, number: int) -> dict[str, str]:
    """sasl.username/sasl.password from a PLAIN or SCRAM ``sasl.jaas.config``."""
    match = _JAAS.match(value)
    if match is None or match["module"] not in _PASSWORD_MODULES:
        raise _fail(
            source,
            number,
            "sasl.jaas.config is understood for the PLAIN and SCRAM login modules only",
            hint="set sasl.username and sasl.password (or librdkafka's OAUTHBEARER settings)",
        )
    options = {
        name: raw[1:-1].replace('\\"', '"').replace("\\\\", "\\") if raw.startswith('"') else raw
        for name, raw in _JAAS_OPTION.findall(match["options"])
    }
    if "username" not in options or "password" not in options:
        raise _fail(source, number, "sasl.jaas.config needs username and password")
    return {"sasl.username": options["username"], "sasl.password": options["password"]}


def check_with_librdkafka(properties: dict[str, str], source: str) -> None:
    """Refuse, in one line, what librdkafka refuses: an unknown property, a bad value, a CA file
    that does not load. A client made with them and no bootstrap servers connects nowhere."""
    from confluent_kafka import KafkaException, Producer

    from agentruns.streams.kafka_defaults import KAFKA_LOGS

    try:
        Producer({**properties, **KAFKA_LOGS, "log_level": 0})
    except (KafkaException, ValueError, TypeError) as exc:
        error = exc.args[0] if exc.args else exc
        text = error.str() if hasattr(error, "str") else str(error)
        named = [k for k in properties if f'"{k}"' in text or k in text.split()]
        line = _line_of(source, named[0]) if named else None
        raise _fail(source, line, f"librdkafka refuses it: {text}") from exc


def _line_of(source: str, key: str) -> int | None:
    """Where ``key`` is set in the file ``source`` (for an error message)."""
    try:
        text = Path(source).read_text("utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    for number, logical in _logical_lines(text):
        if logical.split("=", 1)[0].split(":", 1)[0].strip() == key:
            return number
    return None
