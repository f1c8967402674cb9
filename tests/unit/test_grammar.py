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


def batch_tokens(grammars: Grammars, tok: Any, one_op: bool) -> list[list[int]]:
    """Four rows on a random model with SmolLM2's vocabulary, greedy: two held to `yes|no` (one
    also biased), one biased only, one with a repetition penalty that leaves after 3 tokens
    (while it runs, the step takes mlx-lm's row-by-row path; after, the one-op one)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models import llama
    from mlx_lm.sample_utils import make_logits_processors

    from mlxd.engine.gpu.batch_bias import LogitBias, batch_bias

    mx.random.seed(5)
    args = llama.ModelArgs(model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, vocab_size=49152)
    model = llama.Model(args)
    mx.eval(model.parameters())
    grammar = response_format_grammar({"type": "regex", "regex": "(yes|no)( (yes|no))*"})
    assert grammar is not None
    eos = sorted(tok.eos_token_ids)
    rows = [
        [GrammarMask(grammars.matcher(grammar, "p"), eos)],
        [LogitBias({tok.encode("no", add_special_tokens=False)[0]: 5.0}), GrammarMask(grammars.matcher(grammar, "p"), eos)],
        [LogitBias({7: 100.0})],
        make_logits_processors(repetition_penalty=1.5),
    ]
    gen = BatchGenerator(model, completion_batch_size=8, prefill_batch_size=8)
    if one_op:
        assert batch_bias(gen)
    prompts = [tok.encode(f"Answer {i}:", add_special_tokens=False) for i in range(4)]
    uids = gen.insert(prompts, max_tokens=[10, 10, 10, 3], logits_processors=rows)
    out: dict[int, list[int]] = {uid: [] for uid in uids}
    for _ in range(12):
        for r in gen.next_generated():
            out[r.uid].append(int(r.token))
    gen.close()
    return [out[uid] for uid in uids]


def test_the_batch_lanes_one_op_mask_gives_what_row_by_row_masks_give(grammars: Grammars, tok: Any) -> None:
    got = batch_tokens(grammars, tok, one_op=True)
    want = batch_tokens(grammars, tok, one_op=False)
    assert got == want
    assert [len(r) for r in got] == [10, 10, 10, 3]
    for held in got[:2]:
        text = tok.decode([t for t in held if t not in tok.eos_token_ids])
        assert text and set(text.split()) <= {"yes", "no"}, text
    assert set(got[2]) == {7}


def test_device_words_upload_a_bitmask_once_per_content_and_keep_the_last_few() -> None:
    import numpy as np

    from mlxd.engine.chat.grammar import DeviceWords

    cache = DeviceWords(size=2)
    a, b, c = (np.full((1, 3), v, dtype=np.uint32) for v in (1, 2, 3))
    first = cache.get(a)
    assert cache.get(a.copy()) is first  # same content: the array already on the device
    assert cache.get(b) is not first and cache.get(b).tolist() == [[2, 2, 2]]
    cache.get(c)  # a third content: the least recently used (a) goes
    assert cache.get(a) is not first and cache.get(a).tolist() == [[1, 1, 1]]


def test_a_plain_reply_never_imports_llguidance() -> None:
    # a request without response_format must not need llguidance (an install without it, or
    # one where it fails to import, still answers plain chat)
    import subprocess
    import sys

    code = ("import sys; from mlxd.engine.chat.grammar import response_format_grammar; "
            "assert response_format_grammar(None) is None; "
            "assert response_format_grammar({'type': 'text'}) is None; "
            "print('llguidance' in sys.modules); "
            "response_format_grammar({'type': 'json_object'}); print('llguidance' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
