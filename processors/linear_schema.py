"""JSON Schema validation whose cost stays bounded by the document, for schemas from outside.

jsonschema evaluates ``pattern`` and ``patternProperties`` with Python's backtracking ``re``:
a pattern such as ``^(a+)+$`` over a few dozen characters of model arguments takes seconds.
The validator here evaluates them with RE2 (linear time, no backreferences or lookaround), so
a pattern RE2 cannot compile makes a schema unusable rather than slow. ``uniqueItems`` is
checked by hashing (jsonschema compares unsortable items pairwise). Schema keywords shared
through ``$ref`` can multiply the work for one value exponentially (``anyOf`` of two refs to
an ``anyOf`` of two refs...): :func:`first_error` gives each validation a budget of keyword
evaluations proportional to the value's size and raises :class:`TooMuchWork` past it. It
never fetches a remote ``$ref`` (the core does no I/O): an unresolvable reference is an
error of the schema.
"""

from __future__ import annotations

import contextlib
import functools
import reprlib
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import re2
import referencing
from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError
from jsonschema.protocols import Validator

from agentruns.processors.limits import SCHEMA_STEPS_BASE, SCHEMA_STEPS_PER_VALUE_NODE

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # a refused pattern is reported to the caller, not to stderr
# Schema keywords whose values are data, not schemas: a "pattern" inside them is no pattern.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# jsonschema looks for unevaluated properties with Python's ``re`` over patternProperties, in
# a recursive helper no keyword override reaches: a schema combining the two is refused.
UNSUPPORTED_COMBINATION = ("unevaluatedProperties", "patternProperties")


@functools.lru_cache(maxsize=512)
def _regex(pattern: str) -> Any | None:
    # Pure memoization of a pure function (pattern text -> automaton).
    try:
        return re2.compile(pattern, _OPTIONS)
    except Exception:  # re2.error, or a pattern that is not UTF-8 text
        return None


def compiles(pattern: str) -> bool:
    """Whether RE2 accepts ``pattern``."""
    return _regex(pattern) is not None


def search(pattern: str, text: str) -> bool:
    """``re.search`` semantics in linear time; a pattern RE2 refuses matches nothing."""
    regex = _regex(pattern)
    if regex is None:
        return False
    try:
        return regex.search(text) is not None
    except UnicodeError:  # a lone surrogate cannot be matched as UTF-8
        return False


def patterns_in(schema: object) -> Iterator[str]:
    """Every regular expression a schema document holds (``pattern`` values and
    ``patternProperties`` names, at any depth), found without recursion."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key == "pattern" and isinstance(value, str):
                yield value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from (name for name in value if isinstance(name, str))
            if key not in _DATA_KEYWORDS:
                stack.append(value)


def keywords_in(schema: object) -> set[str]:
    """Every key of every object in a schema document (found without recursion)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            found.update(k for k in node if isinstance(k, str))
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return found


def _short(value: Any) -> str:
    """A bounded repr: a violation's message names the value without copying all of it."""
    return reprlib.repr(value)


def _pattern(
    validator: Any, pattern: str, instance: Any, schema: Mapping[str, Any]
) -> Iterator[ValidationError]:
    if validator.is_type(instance, "string") and not search(pattern, instance):
        yield ValidationError(f"{_short(instance)} does not match {pattern!r}")


def _pattern_properties(
    validator: Any,
    pattern_properties: Mapping[str, Any],
    instance: Any,
    schema: Mapping[str, Any],
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in pattern_properties.items():
        for name, value in instance.items():
            if search(pattern, name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def _additional(instance: Mapping[str, Any], schema: Mapping[str, Any]) -> list[str]:
    properties = schema.get("properties", {})
    patterns = list(schema.get("patternProperties", {}))
    return [
        name
        for name in instance
        if name not in properties and not any(search(p, name) for p in patterns)
    ]


def _additional_properties(
    validator: Any, additional: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterator[ValidationError]:
    if not validator.is_type(instance, "object"):
        return
    extras = _additional(instance, schema)  # in the instance's order: deterministic errors
    if validator.is_type(additional, "object"):
        for extra in extras:
            yield from validator.descend(instance[extra], additional, path=extra)
    elif not additional and extras:
        if "patternProperties" in schema:
            joined = ", ".join(repr(each) for each in sorted(extras))
            patterns = ", ".join(repr(each) for each in sorted(schema["patternProperties"]))
            verb = "does" if len(extras) == 1 else "do"
            yield ValidationError(f"{joined} {verb} not match any of the regexes: {patterns}")
        else:
            names = ", ".join(repr(each) for each in sorted(extras, key=str))
            verb = "was" if len(extras) == 1 else "were"
            yield ValidationError(
                f"Additional properties are not allowed ({names} {verb} unexpected)"
            )


# the keyword callables receive the validator instance jsonschema builds (typed Any: the
# protocol omits ``descend``); ``extend`` is untyped in the stubs
def _identity(value: Any) -> Any:
    """A hashable stand-in equal for values JSON Schema calls equal (1 == 1.0, True != 1)."""
    if value is True or value is False:
        return ("bool", value)
    if isinstance(value, str):
        return ("str", value)
    if isinstance(value, list):
        return ("list", tuple(_identity(item) for item in value))
    if isinstance(value, dict):
        return ("dict", frozenset((k, _identity(v)) for k, v in value.items()))
    return ("value", value)  # numbers (1 and 1.0 hash alike) and null


def _unique_items(
    validator: Any, unique: Any, instance: Any, schema: Mapping[str, Any]
) -> Iterator[ValidationError]:
    if not unique or not validator.is_type(instance, "array"):
        return
    if len({_identity(item) for item in instance}) != len(instance):
        yield ValidationError(f"{_short(instance)} has non-unique elements")


class TooMuchWork(Exception):
    """A validation spent its budget of keyword evaluations."""


# The keyword evaluations left to the validation running in this context (None: unbounded).
_STEPS_LEFT: ContextVar[list[int] | None] = ContextVar("schema_steps_left", default=None)
_Keyword = Callable[[Any, Any, Any, Mapping[str, Any]], Any]


def _counted(keyword: _Keyword) -> _Keyword:
    def evaluate(validator: Any, value: Any, instance: Any, schema: Mapping[str, Any]) -> Any:
        left = _STEPS_LEFT.get()
        if left is not None:
            left[0] -= 1
            if left[0] < 0:
                raise TooMuchWork
        return keyword(validator, value, instance, schema)

    return evaluate


_KEYWORDS: dict[str, _Keyword] = {
    **Draft202012Validator.VALIDATORS,
    "pattern": _pattern,
    "patternProperties": _pattern_properties,
    "additionalProperties": _additional_properties,
    "uniqueItems": _unique_items,
}
LinearValidator: type[Validator] = validators.extend(  # type: ignore[no-untyped-call]
    Draft202012Validator, {name: _counted(keyword) for name, keyword in _KEYWORDS.items()}
)
# The metaschemas only: a ``$ref`` to anything else is unresolvable, never fetched.
_LOCAL_ONLY: referencing.Registry[Any] = referencing.Registry()


def validator_for(schema: Mapping[str, Any]) -> Validator:
    """A validator for a (checked) schema: RE2 patterns, no remote references."""
    return LinearValidator(schema, registry=_LOCAL_ONLY)


def _nodes(value: Any) -> int:
    count = 0
    stack = [value]
    while stack:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


@contextlib.contextmanager
def shared_budget() -> Iterator[None]:
    """One budget for every validation inside: SCHEMA_STEPS_BASE once, plus each value's
    share, so many values (a task's tools, a candidate's calls) cost at most their total size.
    An outer budget stays in force."""
    if _STEPS_LEFT.get() is not None:
        yield
        return
    token = _STEPS_LEFT.set([SCHEMA_STEPS_BASE])
    try:
        yield
    finally:
        _STEPS_LEFT.reset(token)


def first_error(validator: Validator, value: Any) -> ValidationError | None:
    """The first violation of ``value``, within a budget of keyword evaluations proportional to
    its size (:class:`TooMuchWork` past it)."""
    with shared_budget():
        left = _STEPS_LEFT.get()
        assert left is not None
        left[0] += SCHEMA_STEPS_PER_VALUE_NODE * _nodes(value)
        return next(iter(validator.iter_errors(value)), None)
