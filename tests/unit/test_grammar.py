"""grammar.py: grammars compiled once per text and copied per request, the forced-call grammar
for each format mlxd writes one for, and GrammarMask holding sampled tokens to a grammar and
then to the end of the reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.chat.grammar import (
    GrammarMask,
    Grammars,
    forced_call_grammar,
    response_format_grammar,
)
from mlxd.protocol.errors import APIError

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "get_time"}}]


@pytest.fixture(scope="module")
def tok(smollm2: Path) -> Any:
    return load_tokenizer(smollm2)


@pytest.fixture(scope="module")
def grammars(tok: Any) -> Grammars:
    return Grammars(tok._tokenizer, sorted(tok.eos_token_ids))


def accepts(grammars: Grammars, tok: Any, grammar: str, text: str) -> bool:
    m = grammars.matcher(grammar, "x")
    return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and m.is_accepting()


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher(grammars: Grammars, tok: Any) -> None:
    text = response_format_grammar({"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}})
    assert text is not None
    a, b = grammars.matcher(text, "p"), grammars.matcher(text, "p")
    assert a is not b
    assert a.consume_tokens(tok.encode('{"city": "Paris"}', add_special_tokens=False))
    assert not b.is_accepting()  # the copy did not move with the other
    assert list(grammars.compile_ms).count(text) == 1


def test_a_grammar_that_does_not_compile_is_a_400_naming_the_param(grammars: Grammars) -> None:
    with pytest.raises(APIError) as err:
        grammars.matcher("start: undefined_rule", "response_format")
    assert err.value.status == 400 and err.value.param == "response_format"


@pytest.mark.parametrize(("fmt", "function", "good", "bad"), [
    ("json_tools", "get_weather", '{"city": "Paris"}}\n</tool_call>', '{"town": "Paris"}}\n</tool_call>'),
    ("json_tools", None, 'get_time", "arguments": {}}\n</tool_call>', 'rm_rf", "arguments": {}}\n</tool_call>'),
    ("llama3_json", "get_weather", '{"city": "Oslo"}}', '{"city": 5}}'),
    ("llama3_json", None, 'get_weather", "parameters": {"city": "Oslo"}}', 'get_weather", "arguments": {"city": "Oslo"}}'),
])
def test_the_forced_call_grammar_holds_the_name_and_the_arguments(
    grammars: Grammars, tok: Any, fmt: str, function: str | None, good: str, bad: str
) -> None:
    grammar = forced_call_grammar(fmt, TOOLS, function, "</tool_call>" if fmt == "json_tools" else "")
    assert grammar is not None
    assert accepts(grammars, tok, grammar, good)
    assert not accepts(grammars, tok, grammar, bad)


def test_formats_mlxd_cannot_write_a_call_grammar_for_get_none() -> None:
    assert forced_call_grammar("mistral", TOOLS, "get_weather", "") is None


def test_the_mask_allows_only_what_the_grammar_allows_then_only_the_end(grammars: Grammars, tok: Any) -> None:
    grammar = response_format_grammar({"type": "regex", "regex": "yes|no"})
    assert grammar is not None
    mask = GrammarMask(grammars.matcher(grammar, "p"), sorted(tok.eos_token_ids))
    vocab = 49152
    prompt = mx.array(tok.encode("Answer:", add_special_tokens=False))
    logits = mx.zeros((1, vocab))
    allowed = mx.isfinite(mask(prompt, logits)).reshape(-1)
    allowed_ids = [i for i, ok in enumerate(allowed.tolist()) if ok]
    texts = {tok.decode([i]) for i in allowed_ids}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), sorted(texts)[:10]
    yes = tok.encode("yes", add_special_tokens=False)
    tokens = mx.concatenate([prompt, mx.array(yes)])
    after = mx.isfinite(mask(tokens, logits)).reshape(-1)
    assert [i for i, ok in enumerate(after.tolist()) if ok] == sorted(tok.eos_token_ids)
