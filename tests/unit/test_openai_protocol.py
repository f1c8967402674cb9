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
        ({"n": 17}, "n"),  # more choices than the batch lane takes for one request
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
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


# ---- numeric ranges: every number is checked while decoding, so none reaches MLX out of range ----

BIG = "1" + "0" * 400  # an int no C type holds (10**400)


def chat_body(**fields: str) -> bytes:
    extra = "".join(f', "{k}": {v}' for k, v in fields.items())
    return b'{"messages": [{"role": "user", "content": "hi"}]' + extra.encode() + b"}"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("top_k", BIG), ("top_k", "-1"), ("top_k", str(2**31)),
        ("max_tokens", BIG), ("max_tokens", str(2**31)), ("max_tokens", "-" + BIG),
        ("max_completion_tokens", BIG), ("max_completion_tokens", "0"),
        ("seed", BIG), ("seed", str(2**63)), ("seed", str(-(2**63) - 1)),
        ("n", BIG), ("n", "129"), ("n", "0"),
        ("top_logprobs", BIG), ("top_logprobs", "21"), ("top_logprobs", "-1"),
        ("temperature", "1e999"), ("temperature", "-1e999"), ("temperature", BIG), ("temperature", "2.01"),
        ("top_p", "1e999"), ("top_p", "-0.1"), ("min_p", "1.5"), ("min_p", BIG),
        ("presence_penalty", "-1e999"), ("presence_penalty", "2.5"), ("frequency_penalty", "-2.5"),
        ("repetition_penalty", "0"), ("repetition_penalty", "1e-300"), ("repetition_penalty", "1e999"),
        ("priority", BIG), ("priority", str(2**31)), ("priority", str(-(2**31) - 1)),
    ],
)
def test_numbers_out_of_range_are_400_naming_the_field(field: str, value: str) -> None:
    err = decode_error(chat_body(**{field: value}), oa.ChatCompletionRequest)
    assert (err.status, err.param, err.code) == (400, field, "invalid_value")


@pytest.mark.parametrize(
    ("field", "value"),
    [("logprobs", "6"), ("logprobs", BIG), ("best_of", "21"), ("best_of", "0"), ("max_tokens", BIG), ("seed", BIG)],
)
def test_completion_numbers_out_of_range_are_400(field: str, value: str) -> None:
    body = f'{{"prompt": "hi", "{field}": {value}}}'.encode()
    assert decode_error(body, oa.CompletionRequest).param == field


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": '{"5": 101}'}, "logit_bias[...]"),
        ({"logit_bias": '{"5": 1e999}'}, "logit_bias[...]"),
        ({"logit_bias": "{" + ", ".join(f'"{i}": 1' for i in range(oa.MAX_LOGIT_BIAS + 1)) + "}"}, "logit_bias"),
        ({"stop": '"' + "x" * (oa.MAX_STOP_CHARS + 1) + '"'}, "stop"),
        ({"stop": '["a", "' + "x" * (oa.MAX_STOP_CHARS + 1) + '"]'}, "stop[1]"),
        ({"stop": "[" + ", ".join(['"s"'] * (oa.MAX_STOPS + 1)) + "]"}, "stop"),
    ],
)
def test_logit_bias_and_stop_bounds(fields: dict[str, str], param: str) -> None:
    assert decode_error(chat_body(**fields), oa.ChatCompletionRequest).param == param


def test_the_edges_of_every_range_are_accepted() -> None:
    body = chat_body(
        top_k=str(2**31 - 1), max_tokens=str(2**31 - 1), max_completion_tokens="1", seed=str(-(2**63)),
        temperature="2", top_p="0", min_p="1", presence_penalty="-2", frequency_penalty="2",
        repetition_penalty="10", logprobs="true", top_logprobs="20", logit_bias='{"0": -100, "7": 100}', n="16",
        stop='["' + "x" * oa.MAX_STOP_CHARS + '"]',
    )
    req = msgspec.json.decode(body, type=oa.ChatCompletionRequest)
    assert (req.top_k, req.seed, req.temperature) == (2**31 - 1, -(2**63), 2.0)
    assert msgspec.json.decode(chat_body(seed=str(2**63 - 1)), type=oa.ChatCompletionRequest).seed == 2**63 - 1
    oa.check_chat(req)


@pytest.mark.parametrize("body", [chat_body(temperature="NaN"), chat_body(top_p="Infinity"), chat_body(top_p="-Infinity")])
def test_nan_and_infinity_are_not_json(body: bytes) -> None:
    assert decode_error(body, oa.ChatCompletionRequest).code == "invalid_json"


@pytest.mark.parametrize("key", ["-1", "1" + "0" * 10, BIG, "\u0663", " 3", "3 ", "+3", "0x3", "1_000", ""])
def test_logit_bias_keys_must_be_plain_token_ids(key: str) -> None:
    with pytest.raises(APIError) as info:
        oa.check_chat(chat(logit_bias={key: 1.0}))
    assert info.value.param == "logit_bias"
    assert len(info.value.message) < 100  # a huge key is not echoed back whole


def test_logit_bias_keys_that_are_token_ids_pass() -> None:
    oa.check_chat(chat(logit_bias={"0": 1.0, "9999999999": -1.0}))


def test_best_of_above_one_is_refused_not_ignored() -> None:
    with pytest.raises(APIError) as info:
        oa.check_completion(oa.CompletionRequest(prompt="hi", best_of=2))
    assert info.value.param == "best_of"
    oa.check_completion(oa.CompletionRequest(prompt="hi", best_of=1))


@pytest.mark.parametrize("value", ['"high"', "1.5", "true", "2147483648"])
def test_a_priority_that_is_not_an_integer_is_a_400_naming_it(value: str) -> None:
    err = decode_error(chat_body(priority=value), oa.ChatCompletionRequest)
    assert (err.status, err.param) == (400, "priority")


def test_priority_is_the_keys_default_unless_sent_and_may_be_negative() -> None:
    # None: the engine takes the key's default (X-MLXD-Priority from the supervisor), else 0.
    assert msgspec.json.decode(chat_body(), type=oa.ChatCompletionRequest).priority is None
    assert msgspec.json.decode(chat_body(priority="null"), type=oa.ChatCompletionRequest).priority is None
    assert msgspec.json.decode(chat_body(priority="-5"), type=oa.ChatCompletionRequest).priority == -5
