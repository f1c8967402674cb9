"""Tool formats on real chat-template renderings: tokenizers written by a fixture (SmolLM2's
vocabulary with Qwen-, Llama-3-, Mistral- and Qwen3-coder-style tool templates), the format
mlxd picks for each (mlx-lm's inference, or mlxd's), tools and earlier calls and results
rendered into the prompt, and a call as the template writes it parsed back by the stream
parser whatever pieces it arrives in."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from mlxd.engine.chat.tool_stream import Call, Content, ToolCallStream
from mlxd.engine.chat.tools import format_of, template_messages, template_takes_tools

QWEN = """{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- if message.content %}
{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA3 = """{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython<|eot_id|>{% endif %}
{%- for message in messages %}
{%- if message.role == "user" and tools and loop.last %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.

{% for t in tools %}{{ t | tojson(indent=4) }}

{% endfor %}{{ message.content }}<|eot_id|>
{%- elif message.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{%- for tc in message.tool_calls %}{% set tc = tc.function %}
{"name": "{{ tc.name }}", "parameters": {{ tc.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif message.role == "tool" %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content | tojson }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{- bos_token }}
{%- for message in messages %}
{%- if message.role == "user" %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ message.content }}[/INST]
{%- elif message.tool_calls %}
{%- for tc in message.tool_calls %}[TOOL_CALLS]{{ tc.function.name }}[ARGS]{{ tc.function.arguments | tojson }}{% endfor %}{{ eos_token }}
{%- elif message.role == "tool" %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]
{%- elif message.role == "assistant" %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

QWEN3_CODER = """{%- if tools %}<|im_start|>system
# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<description>{{ tool.function.description }}</description>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}
<tool_call>
<function={{ tool_call.name }}>
{%- for k, v in tool_call.arguments.items() %}
<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{%- endfor %}
</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# the format mlxd picks, and what ends an assistant turn in the rendering
TEMPLATES = {
    "qwen": (QWEN, "json_tools", ["<|im_end|>\n", "<|im_end|>"]),
    "llama3": (LLAMA3, "llama3_json", ["<|eot_id|>"]),
    "mistral": (MISTRAL, "mistral", ["</s>", "<|endoftext|>", "<|im_end|>"]),
    "qwen3_coder": (QWEN3_CODER, "qwen3_coder", ["<|im_end|>\n", "<|im_end|>"]),
}
HEADERS = {  # what comes between the user's text and the assistant's in each rendering
    "qwen": "<|im_end|>\n<|im_start|>assistant", "llama3": "<|start_header_id|>assistant<|end_header_id|>",
    "mistral": "[/INST]", "qwen3_coder": "<|im_end|>\n<|im_start|>assistant",
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
ARGS = {"city": "Paris", "days": 3}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}


@pytest.fixture(scope="module")
def tokenizers(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for name, (template, _, _) in TEMPLATES.items():
        d = tmp_path_factory.mktemp(f"tok-{name}")
        for f in ("tokenizer.json", "special_tokens_map.json"):
            shutil.copy(smollm2 / f, d / f)
        config = json.loads((smollm2 / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (d / "tokenizer_config.json").write_text(json.dumps(config))
        out[name] = load_tokenizer(d)
    return out


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_the_format_is_found_from_the_template(tokenizers: dict[str, Any], name: str) -> None:
    tok = tokenizers[name]
    assert template_takes_tools(tok)
    assert format_of(tok, True).name == TEMPLATES[name][1]


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_tools_an_earlier_call_and_its_result_are_in_the_prompt(tokenizers: dict[str, Any], name: str) -> None:
    tok = tokenizers[name]
    fmt = format_of(tok, True)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                {"role": "user", "content": "And tomorrow?"}]
    text = tok.apply_chat_template(template_messages(messages, fmt, [WEATHER]), tools=[WEATHER],
                                   add_generation_prompt=True, tokenize=False)
    assert "The current weather in a city." in text or "get_weather" in text.split("Weather in Paris?")[0]
    assert "sunny, 21 C" in text
    assert "Paris" in text.split("Weather in Paris?", 1)[1]  # the earlier call's arguments, as objects
    assert '"{\\"city' not in text  # not a JSON string inside JSON


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_a_call_as_the_template_writes_it_parses_back_from_any_pieces(tokenizers: dict[str, Any], name: str) -> None:
    tok = tokenizers[name]
    fmt = format_of(tok, True)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    whole = tok.apply_chat_template(template_messages([*ask, {"role": "assistant", "tool_calls": [CALL, CALL]}], fmt, [WEATHER]),
                                    tools=[WEATHER], tokenize=False)
    reply = whole.split("Weather in Paris?", 1)[1].split(HEADERS[name], 1)[1]
    for end in TEMPLATES[name][2]:
        reply = reply.removesuffix(end)
    rng = random.Random(7)
    for trial in range(25):
        cuts = sorted(rng.sample(range(1, len(reply)), min(len(reply) - 1, trial)))
        pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
        stream = ToolCallStream(fmt.markup, [WEATHER])
        events = [e for p in pieces for e in stream.feed(p)] + stream.finish()
        calls = [e for e in events if isinstance(e, Call)]
        content = "".join(e.text for e in events if isinstance(e, Content))
        assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)] * 2, reply
        assert content.strip() == "", reply


def test_a_template_that_ignores_tools_gets_them_in_a_system_message_and_calls_in_hermes_tags(smollm2: Path) -> None:
    tok = load_tokenizer(smollm2)  # SmolLM2's own template has no tools
    assert not template_takes_tools(tok)
    fmt = format_of(tok, False)
    assert (fmt.name, fmt.in_template, fmt.markup.start) == ("hermes_fallback", False, "<tool_call>")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = tok.apply_chat_template(template_messages(messages, fmt, [WEATHER]), add_generation_prompt=True, tokenize=False)
    system = text.split("Weather?")[0]
    assert "Be brief." in system and "The current weather in a city." in system and "<tool_call>" in system
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_chat_reply_keeps_only_the_first_call_when_parallel_calls_are_off() -> None:
    from mlxd.engine.chat.tools import check_tools
    from mlxd.engine.http.openai_replies import ChatReply
    from mlxd.protocol.events import Done

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "%s"}}</tool_call>'
    for parallel, expected in ((None, ["A", "B"]), (False, ["A"])):
        req = check_tools([WEATHER], "auto", parallel)
        reply = ChatReply("id", 0, "m", tool_req=req, markup=format_of(object(), False).markup)
        reply.text(call % "A" + "\n" + call % "B")
        message, finish = reply.message(Done("stop", 5, 9, 0))
        assert finish == "tool_calls" and message.content is None
        assert [json.loads(c["function"]["arguments"])["city"] for c in message.tool_calls or []] == expected
