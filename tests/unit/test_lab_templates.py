"""Dataset templates (mlxd/lab/templates.py) and the dataset worker's handling of answers that
ran to their length cap (mlxd/lab/dataset.py): inputs checked with defaults filled, each row's
request different, every schema closed and capped."""

from __future__ import annotations

import pytest

from mlxd.lab.dataset import Unusable, _last_sentence
from mlxd.lab.templates import TEMPLATES, TemplateError, max_tokens_for, resolve_inputs

REQUIRED = {"qa": {"topic": "tides"}, "instruct": {"task": "summarize"}, "rewrite": {"style": "formal English"},
            "classify": {"labels": "yes, no"}}


@pytest.mark.parametrize("template_id", sorted(TEMPLATES))
def test_each_template_asks_a_capped_closed_schema_and_rows_differ(template_id: str) -> None:
    template, inputs = resolve_inputs(template_id, REQUIRED[template_id])
    assert set(inputs) == {spec.name for spec in template.info.inputs}  # defaults filled
    prompts = set()
    for i in range(8):
        prompt, schema = template.ask(inputs, i, 8)
        prompts.add(prompt)
        assert schema["additionalProperties"] is False and schema["required"] == list(schema["properties"])
        strings = [p for p in schema["properties"].values() if "maxLength" in p]
        assert strings and max_tokens_for(schema) > 4 * sum(p["maxLength"] for p in strings)
        answer = {name: ("happy" if "enum" not in spec else spec["enum"][0]) for name, spec in schema["properties"].items()}
        row = template.row(inputs, answer)
        assert ("messages" in row) == (template.info.format == "chat") and template.key(row)
    assert len(prompts) == 8


def test_classify_asks_for_the_labels_in_turn() -> None:
    template, inputs = resolve_inputs("classify", {"labels": "spam, ham ,eggs"})
    asked = [template.ask(inputs, i, 6)[1]["properties"]["label"]["enum"] for i in range(6)]
    assert asked == [["spam"], ["ham"], ["eggs"]] * 2


@pytest.mark.parametrize(("template_id", "given", "says"), [
    ("nope", {}, "Unknown template 'nope'; the templates: qa"),
    ("qa", {}, "needs the input 'topic'"),
    ("qa", {"topic": "  "}, "needs the input 'topic'"),
    ("qa", {"topic": "t", "colour": "red"}, "takes no input 'colour'"),
    ("qa", {"topic": "t", "max_answer_chars": "many"}, "'max_answer_chars' must be an integer"),
    ("qa", {"topic": "t", "max_answer_chars": True}, "'max_answer_chars' must be an integer"),
    ("qa", {"topic": "t", "max_answer_chars": 0}, "'max_answer_chars' must be an integer"),
    ("qa", {"topic": 7}, "'topic' must be a string"),
    ("classify", {"labels": "only-one"}, "at least two labels"),
])
def test_bad_inputs_are_named(template_id: str, given: dict[str, object], says: str) -> None:
    with pytest.raises(TemplateError, match=says.replace("(", r"\(")):
        resolve_inputs(template_id, given)


def test_an_answer_cut_at_its_cap_keeps_its_whole_sentences() -> None:
    assert _last_sentence("Tides rise and fall twice a day. The moon pulls the sea tow", "answer") == \
        "Tides rise and fall twice a day."
    assert _last_sentence("Is it high? Yes, it is! It is 3.5 m high and th", "answer") == "Is it high? Yes, it is!"
    with pytest.raises(Unusable, match="no whole sentence"):
        _last_sentence("No end at all in this one", "answer")
    with pytest.raises(Unusable):
        _last_sentence("A. then a long tail with no end that goes on and on and on", "answer")  # too little kept
