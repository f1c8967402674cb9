"""Structured output through a real engine on SmolLM2 with the openai SDK: a JSON schema, a
JSON object and a regex held while decoding (llguidance), streamed or not, in both lanes at
once; bad formats and schemas answered with a 400 naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.support import EngineProcess

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


def ask(smol_batch_client: openai.OpenAI, content: str, fmt: Any, **kw: Any) -> Any:
    args = {"model": "smol", "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 80,
            "response_format": fmt, **kw}
    return smol_batch_client.chat.completions.create(**args)


def check_person(text: str) -> None:
    person = json.loads(text)
    assert set(person) == {"name", "age", "city"}
    assert isinstance(person["name"], str) and type(person["age"]) is int and person["city"] in PERSON["properties"]["city"]["enum"]


def test_a_json_schema_is_held_and_the_reply_ends_with_it(smol_batch_client: openai.OpenAI) -> None:
    out = ask(smol_batch_client, "Describe a person.", SCHEMA_FORMAT)
    assert out.choices[0].finish_reason == "stop"
    check_person(out.choices[0].message.content)


def test_streamed_the_same(smol_batch_client: openai.OpenAI) -> None:
    whole = ask(smol_batch_client, "Describe a person.", SCHEMA_FORMAT).choices[0].message.content
    chunks = ask(smol_batch_client, "Describe a person.", SCHEMA_FORMAT, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole


def test_different_schemas_at_once_each_hold_in_the_batch_lane(smol_batch_client: openai.OpenAI) -> None:
    formats = [SCHEMA_FORMAT, {"type": "regex", "regex": "(yes|no), [a-z]+"}, SCHEMA_FORMAT, None]
    prompts = ["Describe a person.", "Is Paris in France?", "Describe someone from Oslo.", "Say hi."]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda a: ask(smol_batch_client, a[0], a[1], max_tokens=60), zip(prompts, formats, strict=True)))
    check_person(outs[0].choices[0].message.content)
    assert re.fullmatch("(yes|no), [a-z]+", outs[1].choices[0].message.content)
    check_person(outs[2].choices[0].message.content)
    assert outs[3].choices[0].message.content  # unconstrained beside them


def test_json_object_gives_an_object(smol_batch_client: openai.OpenAI) -> None:
    out = ask(smol_batch_client, "Describe a person as JSON.", {"type": "json_object"}, max_tokens=64)
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(out.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert out.choices[0].message.content.lstrip().startswith("{")


BAD: list[tuple[str, Any, str]] = [
    ("not an object", "json", "response_format"),
    ("unknown type", {"type": "xml"}, "response_format.type"),
    ("json_schema without the object", {"type": "json_schema"}, "response_format.json_schema"),
    ("schema not an object", {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema"),
    ("schema llguidance refuses", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "response_format"),
    ("name not a string", {"type": "json_schema", "json_schema": {"name": 5, "schema": {}}}, "response_format.json_schema.name"),
    ("regex not a string", {"type": "regex", "regex": 5}, "response_format.regex"),
    ("regex that does not compile", {"type": "regex", "regex": "(unclosed"}, "response_format"),
    ("lark that does not compile", {"type": "lark", "lark": "start: nothing_defined"}, "response_format"),
]


@pytest.mark.parametrize(("fmt", "param"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_formats_get_a_400_naming_the_field(smol_batch_engine: EngineProcess, fmt: Any, param: str) -> None:
    resp = smol_batch_engine.client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "response_format": fmt})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"]


def test_vllms_guided_fields_hold_the_reply_as_response_format_does(smol_batch_client: openai.OpenAI) -> None:
    def guided(**extra: Any) -> str:
        out = smol_batch_client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Describe a person."}], temperature=0, max_tokens=80,
            extra_body=extra)
        return str(out.choices[0].message.content)

    check_person(guided(guided_json=PERSON))
    small = {"type": "object", "properties": {"age": {"type": "integer", "maximum": 99}}, "required": ["age"],
             "additionalProperties": False}
    as_text = guided(guided_json=json.dumps(small))  # a string, parsed
    assert list(json.loads(as_text)) == ["age"] and as_text == guided(structured_outputs={"json": small})
    assert guided(guided_choice=["a cat", "a dog (small)"]) in ("a cat", "a dog (small)")
    assert re.fullmatch("[0-9]{3}", guided(guided_regex="[0-9]{3}"))
    assert re.fullmatch("x[0-9]{1,3}", guided(guided_grammar='start: "x" /[0-9]{1,3}/'))
    assert guided(structured_outputs={"choice": ["yes", "no"]}) in ("yes", "no")


def test_a_text_completion_is_held_to_its_response_format(smol_batch_client: openai.OpenAI) -> None:
    out = smol_batch_client.completions.create(model="smol", prompt="My favourite number is", temperature=0,
                                               max_tokens=12, extra_body={"response_format": {"type": "regex",
                                                                                            "regex": " [0-9]{2}"}})
    assert re.fullmatch(" [0-9]{2}", out.choices[0].text) and out.choices[0].finish_reason == "stop"
    schema = smol_batch_client.completions.create(model="smol", prompt="A person as JSON:", temperature=0, max_tokens=80,
                                                  extra_body={"guided_json": PERSON})
    check_person(schema.choices[0].text)


@pytest.mark.parametrize(("body", "param"), [
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice[1]"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    # what llguidance refuses is named by the field the caller sent, not by response_format
    ({"guided_json": {"type": "objectx"}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: nothing_defined"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
])
def test_bad_guided_fields_get_a_400_naming_the_field(smol_batch_engine: EngineProcess, body: dict[str, Any],
                                                     param: str) -> None:
    for path, base in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        resp = smol_batch_engine.client.post(path, json={**base, "max_tokens": 4, **body})
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json()["error"]["param"] == param, (path, resp.text)
