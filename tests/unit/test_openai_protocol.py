"""Request decoding and validation: bad input is a 400 that names the field."""

from __future__ import annotations

import msgspec
import pytest

from mlxd.protocol import openai as oa
from mlxd.protocol.errors import APIError, from_decode_error


def decode_error(body: bytes, kind: type) -> APIError:
    with pytest.raises(msgspec.MsgspecError) as info:
        msgspec.json.decode(body, type=kind)
    return from_decode_error(info.value)


def test_wrong_type_names_the_field() -> None:
    err = decode_error(b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}', oa.ChatCompletionRequest)
    assert err.status == 400
    assert err.param == "temperature"
    assert "temperature" in err.message


def test_nested_field_path_is_named() -> None:
    err = decode_error(b'{"messages": [{"role": "robot", "content": "hi"}]}', oa.ChatCompletionRequest)
    assert err.param == "messages[0].role"


def test_out_of_range_and_missing_fields() -> None:
    assert decode_error(b'{"messages": [{"role": "user"}], "top_p": 1.5}', oa.ChatCompletionRequest).param == "top_p"
    assert decode_error(b'{"messages": [], "model": "m"}', oa.ChatCompletionRequest).param == "messages"
    err = decode_error(b'{"model": "m"}', oa.ChatCompletionRequest)
    assert "messages" in err.message


def test_malformed_json_is_invalid_json() -> None:
    err = decode_error(b'{"messages": [', oa.ChatCompletionRequest)
    assert err.code == "invalid_json"
    assert err.param is None


def test_unknown_fields_are_ignored() -> None:
    req = msgspec.json.decode(b'{"messages": [{"role": "user", "content": "hi"}], "metadata": {"a": 1}}', type=oa.ChatCompletionRequest)
    assert req.messages[0].content == "hi"


def chat(**fields: object) -> oa.ChatCompletionRequest:
    return oa.ChatCompletionRequest(messages=[oa.ChatMessage(role="user", content="hi")], **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"n": 2}, "n"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"logprobs": True}, "logprobs"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias"),
    ],
)
def test_unsupported_options_are_refused_not_ignored(fields: dict[str, object], param: str) -> None:
    with pytest.raises(APIError) as info:
        oa.check_chat(chat(**fields))
    assert info.value.status == 400
    assert info.value.param == param


def test_text_parts_are_joined_and_images_refused() -> None:
    msg = oa.ChatMessage(role="user", content=[{"type": "text", "text": "a"}, {"type": "text", "text": "b"}])
    assert oa.message_text(msg, 0) == "ab"
    img = oa.ChatMessage(role="user", content=[{"type": "image_url", "image_url": {"url": "x"}}])
    with pytest.raises(APIError) as info:
        oa.message_text(img, 3)
    assert info.value.param == "messages[3].content[0]"


def test_stop_list_normalizes_and_bounds() -> None:
    assert oa.stop_list(None) == []
    assert oa.stop_list("x") == ["x"]
    assert oa.stop_list(["a", "b"]) == ["a", "b"]
    with pytest.raises(APIError):
        oa.stop_list(["s"] * (oa.MAX_STOPS + 1))


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hi", "hi"), ([1, 2], [1, 2]), (["hi"], "hi"), ([[1, 2]], [1, 2])],
)
def test_completion_prompt_forms(prompt: object, expected: object) -> None:
    assert oa.completion_prompt(oa.CompletionRequest(prompt=prompt)) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt", [["a", "b"], [[1], [2]], [1, "a"], [1.5], []])
def test_completion_prompt_rejects_batches_and_junk(prompt: list[object]) -> None:
    with pytest.raises(APIError) as info:
        oa.completion_prompt(oa.CompletionRequest(prompt=prompt))
    assert info.value.param == "prompt"
