"""Request bodies: depth limit and decode errors as 400s."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlxd.protocol.errors import APIError
from mlxd.protocol.json_body import MAX_JSON_DEPTH, decode_as, json_depth_exceeds


class Body(msgspec.Struct):
    model: str | None = None


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_depth_at_the_limit_passes_and_one_more_does_not() -> None:
    assert not json_depth_exceeds(nested(MAX_JSON_DEPTH))
    assert json_depth_exceeds(nested(MAX_JSON_DEPTH + 1))


def test_brackets_inside_strings_do_not_count() -> None:
    body = json.dumps({"a": "[" * 500, "b": "{\\\"[" * 100}).encode()
    assert not json_depth_exceeds(body)


def test_many_shallow_siblings_are_fine() -> None:
    assert not json_depth_exceeds(b"[" + b",".join([b"[[1]]"] * 10_000) + b"]")


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(alphabet="[]{}\"\\ab"),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet="[]{}\"ab", max_size=3), inner, max_size=3),
    max_leaves=30,
)


def depth_of(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    return 0


@given(json_values, st.integers(min_value=0, max_value=8))
def test_depth_matches_a_recursive_count(value: object, limit: int) -> None:
    assert json_depth_exceeds(json.dumps(value).encode(), limit) is (depth_of(value) > limit)


@pytest.mark.parametrize("body", [b'{"model": ' + nested(2000) + b"}", b'{"x": ' + nested(200) + b"}"])
def test_deep_bodies_are_400_json_too_deep(body: bytes) -> None:
    with pytest.raises(APIError) as info:
        decode_as(body, Body)
    assert (info.value.status, info.value.code) == (400, "json_too_deep")


@pytest.mark.parametrize("body", [b"{", b"[]", b'{"model": 1}', b"\xff"])
def test_bad_bodies_are_400(body: bytes) -> None:
    with pytest.raises(APIError) as info:
        decode_as(body, Body)
    assert info.value.status == 400


def test_the_brackets_are_counted_until_past_the_most_asked() -> None:
    from mlxd.protocol.json_body import _num_opening

    assert _num_opening(b'{"a": [1, {"b": [2]}], "c": "x"}', 10) == 4
    assert _num_opening(b"[" * 50 + b"{" * 50, 5) == 6  # stops one past
    assert _num_opening(b'"' + b"A" * 100_000 + b'"', 5) == 0
