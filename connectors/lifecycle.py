"""How a command's process runs and ends: SIGTERM and SIGINT ask a service's loop to finish
what it holds; an AgentrunsError, a Kafka client's error that escaped its adapter, or an OS
error (a file, a port) ends the command with one line on stderr, never a trace. SIGUSR1 writes
the stack of every thread to stderr and the process goes on (what a service that stands still
is waiting for)."""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Sequence

from confluent_kafka import KafkaException

from agentruns.streams.errors import AgentrunsError, FatalConsumerError

#: The exit code of a service that stops so that its supervisor starts it again (its consumer
#: was fenced: a fresh member joins where this one cannot): sysexits' EX_TEMPFAIL, not the 2 of
#: an error someone must act on.
RESTART_ME = 75


def stop_on_signals() -> threading.Event:
    """An event that SIGTERM and SIGINT set, so a service's loop finishes what it holds, closes
    cleanly and exits 0 (call from the main thread)."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    return stop


def progress(command: str) -> Callable[[str], None]:
    """Where a long command says how far it got: a line on stderr, `<command>: <text>`, so its
    output on stdout stays what it prints as its result."""

    def say(text: str) -> None:
        print(f"{command}: {text}", file=sys.stderr, flush=True)

    return say


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run_command(main: Callable[[list[str]], int], argv: Sequence[str] | None = None) -> int:
    """A command's exit code: what `main` returns, 2 after an error the user can act on (one
    line on stderr), `RESTART_ME` when a service stopped to be started again, 130 after Ctrl-C.
    A module run with `python -m` calls its own `main` through this, never the CLI's
    dispatcher, which would import the module a second time (and register its metrics twice).

    Every command takes the global ``--kafka-config FILE`` (anywhere before a ``--``) and
    loads the settings (`settings.load`) before it runs."""
    from agentruns.connectors import settings

    with contextlib.suppress(OSError, ValueError):  # a stderr with no descriptor: no dumps
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # SIGTERM ends a command as Ctrl-C does, through its cleanup (a bench or a chaos run stops
    # the broker and processes it started), not at once; services install their own handler.
    main_thread = threading.current_thread() is threading.main_thread()
    terminate = main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    if terminate:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        words, kafka_config = settings.take_kafka_config_flag(
            list(sys.argv[1:] if argv is None else argv)
        )
        with settings.loaded({"kafka_config": kafka_config}):
            return int(main(words))
    except FatalConsumerError as exc:
        _fail(exc.one_line())
        return RESTART_ME
    except AgentrunsError as exc:
        return _fail(exc.one_line())
    except KafkaException as exc:
        return _fail(f"Kafka: {exc.args[0].str() if exc.args else exc}")
    except OSError as exc:
        return _fail(str(exc) or _where(exc))
    except KeyboardInterrupt:
        return 130
    finally:
        if terminate:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _where(exc: BaseException) -> str:
    """What an error without a message is and where it was raised (a future's TimeoutError
    says nothing by itself)."""
    frames = traceback.extract_tb(exc.__traceback__)
    # the last frame of ours, not the standard library's future that raised it
    ours = [f for f in frames if "/lib/python" not in f.filename] or frames
    at = f" at {ours[-1].filename}:{ours[-1].lineno} in {ours[-1].name}" if ours else ""
    return f"{type(exc).__name__}{at}"


def _fail(line: str) -> int:
    print(f"agentruns: {' '.join(line.split())}", file=sys.stderr)  # one line, whatever it holds
    return 2
