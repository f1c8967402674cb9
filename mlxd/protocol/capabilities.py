"""What a model takes and does, read from its files (config.json, the processor files, the chat
template): its context window, and whether it takes images and audio, calls tools and reasons. Shown in
`/v1/models`, `mlxd models` and the web page's model picker, so clients can build their menus
from it. Pure: the supervisor reads the files (registry.capabilities_of), the engine agrees on
what a vision-language model is (engine/models/vision.py)."""

from __future__ import annotations

from typing import Any

import msgspec

from mlxd.protocol.memory import context_window, text_config

PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
# Template words that show a model's reasoning block (think_markers in the engine finds the markers).
REASONING_WORDS = ("<think>", "enable_thinking", "reasoning_content", "<|channel|>analysis", "thinking")


class Capabilities(msgspec.Struct, frozen=True):
    context_window: int  # tokens, capped by the model's max_context
    capabilities: list[str]  # of "completion", "vision", "audio", "tools", "reasoning", "embedding" (Ollama's
    # names, but audio and reasoning)


# A sentence-transformers model dir (its modules list): an embedding model, whatever its body.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "config_sentence_transformers.json")
# Heads that make a model a generator (or a classifier), not an encoder of text to a vector.
GENERATOR_HEADS = ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel", "ForMaskedLM",
                   "ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")
# Encoder families served as embedding models when their dir names a bare body (BertModel, ...).
ENCODER_TYPES = ("bert", "xlm-roberta", "xlm_roberta", "modernbert", "nomic_bert", "roberta")


def is_embedding_config(config: dict[str, Any], files: set[str]) -> bool:
    """Whether a model dir is an embedding model: a sentence-transformers dir (modules.json), or
    an encoder family's bare body (architectures like `BertModel`, no generating head)."""
    if any(name in files for name in SENTENCE_TRANSFORMERS_FILES):
        return True
    arches = config.get("architectures") or []
    if not isinstance(arches, list) or not arches:
        return False
    bare = all(isinstance(a, str) and not a.endswith(GENERATOR_HEADS) for a in arches)
    return bare and str(config.get("model_type", "")) in ENCODER_TYPES


def is_vlm_config(config: dict[str, Any], files: set[str]) -> bool:
    """Whether a model dir (its config and file names) is a vision-language model: a vision tower
    in its config and the processor files that prepare its images."""
    return isinstance(config.get("vision_config"), dict) and any(name in files for name in PROCESSOR_FILES)


def capabilities(config: dict[str, Any], files: set[str], template: str | None, max_context: int | None) -> Capabilities:
    """A model's capabilities from its config, its dir's file names and its chat template."""
    if is_embedding_config(config, files):  # it encodes text to vectors and does nothing else
        return Capabilities(context_window(text_config(config), max_context), ["embedding"])
    found = ["completion"]
    if is_vlm_config(config, files):
        found.append("vision")
        if isinstance(config.get("audio_config"), dict):  # an audio tower beside the vision tower
            found.append("audio")
    if template and "tools" in template:
        found.append("tools")
    if template and any(word in template for word in REASONING_WORDS):
        found.append("reasoning")
    return Capabilities(context_window(text_config(config), max_context), found)


def template_text(tokenizer_config: Any, template_file: str | None) -> str | None:
    """The chat template: chat_template.jinja's text, else tokenizer_config.json's (a string, or
    named templates, all of them joined)."""
    if template_file:
        return template_file
    value = tokenizer_config.get("chat_template") if isinstance(tokenizer_config, dict) else None
    if isinstance(value, list):
        return "\n".join(str(t.get("template", "")) for t in value if isinstance(t, dict))
    return value if isinstance(value, str) else None
