"""What a model takes and does, from its files (protocol/capabilities.py)."""

from __future__ import annotations

from mlxd.protocol.capabilities import capabilities, is_vlm_config, template_text

QWEN3_LIKE = "{% if tools %}...{% endif %}{% if enable_thinking %}<think>{% endif %}"


def test_a_vision_tower_with_processor_files_is_a_vlm() -> None:
    vlm = {"vision_config": {"depth": 1}, "text_config": {"max_position_embeddings": 32768}}
    assert is_vlm_config(vlm, {"config.json", "preprocessor_config.json"})
    assert not is_vlm_config(vlm, {"config.json"})  # no processor: the tower cannot be fed
    assert not is_vlm_config({"max_position_embeddings": 8}, {"preprocessor_config.json"})
    found = capabilities(vlm, {"processor_config.json"}, QWEN3_LIKE, None)
    assert found.capabilities == ["completion", "vision", "tools", "reasoning"]
    assert found.context_window == 32768  # the language model's, from text_config


def test_a_plain_model_and_the_context_cap() -> None:
    found = capabilities({"max_position_embeddings": 131072}, {"config.json"}, "{{ messages }}", 8192)
    assert found.capabilities == ["completion"] and found.context_window == 8192
    assert capabilities({}, set(), None, None).capabilities == ["completion"]


def test_the_template_comes_from_the_jinja_file_or_the_tokenizer_config() -> None:
    assert template_text({"chat_template": "a"}, "b") == "b"
    assert template_text({"chat_template": "a"}, None) == "a"
    assert template_text({"chat_template": [{"name": "default", "template": "x"}, {"name": "tool_use",
                                                                                  "template": "tools"}]}, None) == "x\ntools"
    assert template_text(None, None) is None and template_text({"chat_template": 5}, None) is None


def test_an_audio_tower_beside_the_vision_tower_takes_audio() -> None:
    vlm = {"vision_config": {"depth": 1}, "audio_config": {"hidden_size": 32}}
    assert capabilities(vlm, {"processor_config.json"}, None, None).capabilities == ["completion", "vision", "audio"]
    # mlx-vlm builds a default audio tower for some families whose config names none: only a named one counts.
    assert "audio" not in capabilities({**vlm, "audio_config": None}, {"processor_config.json"}, None, None).capabilities


def test_embedding_models_are_sentence_transformers_dirs_or_bare_encoders() -> None:
    from mlxd.protocol.capabilities import is_embedding_config

    bert = {"architectures": ["BertModel"], "model_type": "bert", "max_position_embeddings": 512}
    assert is_embedding_config(bert, {"config.json"})
    assert capabilities(bert, {"config.json"}, None, None).capabilities == ["embedding"]
    # A decoder is an embedding model only as a sentence-transformers dir (Qwen3-Embedding).
    qwen = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert not is_embedding_config(qwen, {"config.json"})
    assert is_embedding_config(qwen, {"config.json", "modules.json"})
    # An encoder with a head is not: a masked-LM or a classifier answers something else.
    assert not is_embedding_config({**bert, "architectures": ["BertForMaskedLM"]}, {"config.json"})
    assert not is_embedding_config({**bert, "architectures": ["BertForSequenceClassification"]}, set())
    assert not is_embedding_config({"model_type": "bert"}, set())  # no architectures: not known to be bare
    assert not is_embedding_config({"architectures": ["LlamaModel"], "model_type": "llama"}, set())
