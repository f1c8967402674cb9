"""Dataset templates: how a dataset job asks a model for one row, and makes the row of its answer.

Each template says what it needs (`inputs`), which of mlx-lm's dataset formats it writes, and
for row `i` of `n` the chat request to send to mlxd's own `/v1/chat/completions`. The answer is
held to a JSON schema by structured output, so even a small model's answer parses; string
lengths are capped in the schema, so an answer always ends before `max_tokens`. Each row's
request names a different angle and a different seed: rows differ even at low temperatures.
No mlx here: the supervisor lists the templates (`GET /lab/dataset/templates`) and checks a
job's inputs against them before it is queued.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

Row = dict[str, Any]
Inputs = dict[str, Any]

ANGLES = (
    "a beginner's question", "a practical how-to", "a common mistake", "a comparison of two things",
    "a surprising fact", "a why question", "a question about history or origins", "an edge case",
    "a question about costs or trade-offs", "a question someone asks an expert", "a step-by-step request",
    "a question about safety or risks", "a definition", "a question with a short exact answer",
    "a scenario to reason about", "a question about the future",
)


class InputSpec(msgspec.Struct, kw_only=True):
    name: str
    description: str
    type: Literal["string", "integer"] = "string"
    default: str | int | None = None
    required: bool = False


class TemplateInfo(msgspec.Struct, kw_only=True):
    """A template as `GET /lab/dataset/templates` lists it."""

    id: str
    name: str
    description: str
    format: Literal["chat", "completions"]
    inputs: list[InputSpec]


@dataclass(frozen=True)
class Template:
    info: TemplateInfo
    ask: Callable[[Inputs, int, int], tuple[str, dict[str, Any]]]  # (prompt, schema) for row i of n
    row: Callable[[Inputs, dict[str, Any]], Row]  # the dataset row of a parsed answer
    key: Callable[[Row], str]  # what makes two rows the same (a repeat is asked again)


def _text(max_chars: int) -> dict[str, Any]:
    return {"type": "string", "minLength": 1, "maxLength": max_chars}


def _within(max_chars: int) -> int:
    """The length a prompt asks for: two thirds of the schema's cap, so that an answer ends by
    itself; one that reaches the cap was cut mid-sentence (the worker asks again)."""
    return max(10, max_chars * 2 // 3)


def _schema(**props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _qa_ask(inp: Inputs, i: int, n: int) -> tuple[str, dict[str, Any]]:
    prompt = (f"Write question {i + 1} of {n} that {inp['audience']} might ask about {inp['topic']}, "
              f"and a helpful, accurate answer of at most {_within(int(inp['max_answer_chars']))} characters. "
              f"This one is {ANGLES[i % len(ANGLES)]}. Answer as JSON with `question` and `answer`.")
    return prompt, _schema(question=_text(300), answer=_text(int(inp["max_answer_chars"])))


def _instruct_ask(inp: Inputs, i: int, n: int) -> tuple[str, dict[str, Any]]:
    prompt = (f"Write task {i + 1} of {n} for an assistant whose job is: {inp['task']}. Give the "
              f"instruction as a user would write it (make it {ANGLES[i % len(ANGLES)]}, self-contained, with "
              f"any text it needs), then the ideal response, at most {_within(int(inp['max_response_chars']))} "
              "characters. Answer as JSON with `instruction` and `response`.")
    return prompt, _schema(instruction=_text(600), response=_text(int(inp["max_response_chars"])))


def _rewrite_ask(inp: Inputs, i: int, n: int) -> tuple[str, dict[str, Any]]:
    limit = int(inp["max_chars"])
    prompt = (f"Write passage {i + 1} of {n}: a few plain sentences about {inp['subject']} "
              f"({ANGLES[i % len(ANGLES)]}, at most {_within(limit)} characters), then the same passage rewritten "
              f"in {inp['style']}, keeping its meaning. Answer as JSON with `original` and `rewritten`.")
    return prompt, _schema(original=_text(limit), rewritten=_text(limit))


def _labels(inp: Inputs) -> list[str]:
    return [label.strip() for label in str(inp["labels"]).split(",") if label.strip()]


def _classify_ask(inp: Inputs, i: int, n: int) -> tuple[str, dict[str, Any]]:
    labels = _labels(inp)
    label = labels[i % len(labels)]  # round robin: the labels come out balanced
    prompt = (f"Write example {i + 1} of {n}: one realistic text from {inp['subject']}, at most "
              f"{_within(int(inp['max_chars']))} characters, whose label is {label!r} (the labels: "
              f"{', '.join(labels)}). Make it {ANGLES[i % len(ANGLES)]}. "
              "Answer as JSON with `text` and `label`.")
    return prompt, _schema(text=_text(int(inp["max_chars"])), label={"type": "string", "enum": [label]})


def _classify_row(inp: Inputs, answer: dict[str, Any]) -> Row:
    return {"messages": [
        {"role": "system", "content": f"Label the user's text. Answer with one of: {', '.join(_labels(inp))}."},
        {"role": "user", "content": answer["text"]},
        {"role": "assistant", "content": answer["label"]},
    ]}


TEMPLATES: dict[str, Template] = {t.info.id: t for t in (
    Template(
        TemplateInfo(id="qa", name="Questions and answers", format="chat",
                     description="Chat rows: a question about a topic and the model's answer.",
                     inputs=[InputSpec(name="topic", description="What the questions are about", required=True),
                             InputSpec(name="audience", description="Who asks", default="a curious adult"),
                             InputSpec(name="max_answer_chars", description="The longest answer, in characters",
                                       type="integer", default=600)]),
        _qa_ask,
        lambda inp, a: {"messages": [{"role": "user", "content": a["question"]},
                                     {"role": "assistant", "content": a["answer"]}]},
        lambda row: row["messages"][0]["content"].strip().lower(),
    ),
    Template(
        TemplateInfo(id="instruct", name="Instructions and responses", format="completions",
                     description="Completion rows: an instruction for a task and the ideal response.",
                     inputs=[InputSpec(name="task", description="The assistant's job, e.g. 'summarize a paragraph'",
                                       required=True),
                             InputSpec(name="max_response_chars", description="The longest response, in characters",
                                       type="integer", default=800)]),
        _instruct_ask,
        lambda inp, a: {"prompt": a["instruction"], "completion": a["response"]},
        lambda row: row["prompt"].strip().lower(),
    ),
    Template(
        TemplateInfo(id="rewrite", name="Rewrite in a style", format="chat",
                     description="Chat rows: a plain passage to rewrite, and its rewrite in a style.",
                     inputs=[InputSpec(name="style", description="The style, e.g. 'formal business English'",
                                       required=True),
                             InputSpec(name="subject", description="What the passages are about", default="everyday life"),
                             InputSpec(name="max_chars", description="The longest passage, in characters",
                                       type="integer", default=500)]),
        _rewrite_ask,
        lambda inp, a: {"messages": [
            {"role": "user", "content": f"Rewrite this in {inp['style']}:\n\n{a['original']}"},
            {"role": "assistant", "content": a["rewritten"]}]},
        lambda row: row["messages"][0]["content"].strip().lower(),
    ),
    Template(
        TemplateInfo(id="classify", name="Label texts", format="chat",
                     description="Chat rows: a text and its label, the labels in turn (balanced).",
                     inputs=[InputSpec(name="labels", description="The labels, comma-separated", required=True),
                             InputSpec(name="subject", description="Where the texts come from",
                                       default="customer messages"),
                             InputSpec(name="max_chars", description="The longest text, in characters",
                                       type="integer", default=300)]),
        _classify_ask,
        _classify_row,
        lambda row: row["messages"][1]["content"].strip().lower(),
    ),
)}


class TemplateError(ValueError):
    """The template or its inputs are wrong; the message says how."""


def resolve_inputs(template_id: str, given: Inputs) -> tuple[Template, Inputs]:
    """The template and its inputs with defaults filled; TemplateError naming what is wrong."""
    template = TEMPLATES.get(template_id)
    if template is None:
        raise TemplateError(f"Unknown template {template_id[:100]!r}; the templates: {', '.join(TEMPLATES)}.")
    specs = {spec.name: spec for spec in template.info.inputs}
    if unknown := sorted(set(given) - set(specs)):
        raise TemplateError(f"Template {template_id!r} takes no input {unknown[0]!r} (it takes: {', '.join(specs)}).")
    out: Inputs = {}
    for spec in template.info.inputs:
        value = given.get(spec.name, spec.default)
        if value is None or (isinstance(value, str) and not value.strip()):
            if spec.required:
                raise TemplateError(f"Template {template_id!r} needs the input {spec.name!r}: {spec.description}.")
            continue
        if spec.type == "integer":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
                raise TemplateError(f"Input {spec.name!r} must be an integer from 1 to 100000.")
        elif not isinstance(value, str) or len(value) > 2000:
            raise TemplateError(f"Input {spec.name!r} must be a string of at most 2000 characters.")
        out[spec.name] = value
    if template_id == "classify" and len(_labels(out)) < 2:
        raise TemplateError("Input 'labels' needs at least two labels, comma-separated.")
    return template, out


def max_tokens_for(schema: dict[str, Any]) -> int:
    """Enough tokens for any answer the schema allows: a character can take up to 4 tokens
    (a byte each, in byte-level vocabularies), and the JSON around the strings some more."""
    chars = sum(p.get("maxLength", 100) for p in schema["properties"].values())
    return 4 * chars + 64 * len(schema["properties"]) + 32
