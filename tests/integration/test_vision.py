"""Images through real supervisors and engines: tiny random VLMs built from mlx-vlm's own model
classes (a Qwen2-VL shape and a Gemma 3 shape), asked with the openai and anthropic SDKs."""

from __future__ import annotations

import base64
import concurrent.futures
import io
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from PIL import Image

from tests.support import SupervisorProcess

FAMILIES = ("qwen2_vl", "gemma3")


def png(seed: int, width: int = 100, height: int = 120, fmt: str = "PNG") -> bytes:
    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8")
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_message(data: bytes, text: str = "What is in this picture?") -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(data)}},
                                         {"type": "text", "text": text}]}]


def config(models: dict[str, Path], model_lines: str = "", pool_lines: str = "") -> str:
    tables = [f'[models.{name}]\npath = "{path}"\n{model_lines}' for name, path in models.items()]
    return "[pool]\nmax_loaded = 3\n" + pool_lines + "".join(tables)


@pytest.fixture(scope="module")
def sup(vlms: dict[str, Path], tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    models = {**vlms, "text": tiny_model}
    proc = SupervisorProcess(config(models), tmp_path_factory.mktemp("vision")).wait_up()
    yield proc
    proc.stop()


def ask(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], **kw: Any) -> Any:
    return client.chat.completions.create(model=model, messages=messages, max_tokens=kw.pop("max_tokens", 8),
                                          temperature=0, logprobs=True, **kw)


def token_ids(answer: Any) -> list[str]:
    return [t.token for t in answer.choices[0].logprobs.content]


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_request_answers_and_counts_its_image_tokens(sup: SupervisorProcess, family: str) -> None:
    client = sup.openai()
    with_image = ask(client, family, image_message(png(0)))
    text_only = ask(client, family, [{"role": "user", "content": "What is in this picture?"}])
    assert with_image.choices[0].finish_reason == "length" and len(token_ids(with_image)) == 8
    # The image's tokens are in prompt_tokens: 16 of them in both tiny models (and its markers).
    assert with_image.usage.prompt_tokens >= text_only.usage.prompt_tokens + 16
    # A text-only request to a VLM works as with any model, and differs from the image's answer.
    assert len(token_ids(text_only)) == 8


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_image_hits_the_cache_and_another_image_misses(sup: SupervisorProcess, family: str) -> None:
    client = sup.openai()
    ask(client, family, image_message(png(12), "Describe it."))  # the template's opening cached, whatever ran before
    first = ask(client, family, image_message(png(10), "Describe it."))
    again = ask(client, family, image_message(png(10), "Describe it."))
    prompt = first.usage.prompt_tokens
    opening = first.usage.prompt_tokens_details.cached_tokens  # the template's start, before the image
    assert opening <= prompt - 16 - 4
    assert again.usage.prompt_tokens_details.cached_tokens == prompt - 1
    assert token_ids(again) == token_ids(first)
    # A follow-up question about the same image reuses its prefix, the image's KV included.
    follow = ask(client, family, image_message(png(10), "Describe it. Now say what colour dominates."))
    # Another image of the same size shares only what precedes the image's tokens.
    other = ask(client, family, image_message(png(11), "Describe it."))
    assert other.usage.prompt_tokens == prompt
    assert other.usage.prompt_tokens_details.cached_tokens == opening
    # The follow-up reused the image's 16 tokens and the text up to where its question differs.
    assert follow.usage.prompt_tokens_details.cached_tokens >= other.usage.prompt_tokens_details.cached_tokens + 16 + 4


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_mixing_image_and_text_rows_matches_each_alone(
    vlms: dict[str, Path], tmp_path: Path, family: str,
) -> None:
    # No prompt cache: every row, alone or batched, runs its image's prefill.
    proc = SupervisorProcess(config({family: vlms[family]}, "batch = 4\n", "prompt_cache_bytes = 0\n"), tmp_path).wait_up()
    try:
        client = proc.openai()
        requests = [image_message(png(20)), [{"role": "user", "content": "Hello there, how are you?"}],
                    image_message(png(21), "What is it?"), [{"role": "user", "content": "Paris is the capital of"}]]
        alone = [token_ids(ask(client, family, m, max_tokens=12, user=f"alone{i}")) for i, m in enumerate(requests)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda im: token_ids(ask(client, family, im[1], max_tokens=12)), enumerate(requests)))
        assert together == alone
    finally:
        proc.stop()


def test_after_a_drain_and_restart_the_same_image_comes_back_from_ssd(vlms: dict[str, Path], tmp_path: Path) -> None:
    proc = SupervisorProcess(config({"qwen2_vl": vlms["qwen2_vl"]}), tmp_path).wait_up()
    try:
        client = proc.openai()
        cold = ask(client, "qwen2_vl", image_message(png(30)))
        unload = proc.client.post("/admin/unload", json={"model": "qwen2_vl"})
        assert unload.status_code == 200 and unload.json()["drain"]["cache_complete"] is True
        back = ask(client, "qwen2_vl", image_message(png(30)))  # a new engine: the entry from SSD
        assert back.usage.prompt_tokens_details.cached_tokens == cold.usage.prompt_tokens - 1
        assert token_ids(back) == token_ids(cold)
        assert proc.engine_stats("qwen2_vl")["prompt_cache"]["hits"]["ssd"] == 1
        other = ask(client, "qwen2_vl", image_message(png(31)))
        assert other.usage.prompt_tokens_details.cached_tokens < cold.usage.prompt_tokens - 16
    finally:
        proc.stop()


def big_png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height)).save(out, "PNG")
    return out.getvalue()


def ppm() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "PPM")
    return out.getvalue()


BAD_PARTS = [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgoAAAANSUhEUg=="}}, "invalid_image"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,%%%"}}, "invalid_image"),
    ({"type": "image_url", "image_url": {"url": data_uri(b"not an image at all")}}, "invalid_image"),
    ({"type": "image_url", "image_url": {"url": data_uri(ppm(), "image/x-portable-pixmap")}}, "invalid_image"),
    ({"type": "image_url", "image_url": {"url": data_uri(big_png(8000, 7000))}}, "image_too_large"),
    ({"type": "image_url", "image_url": {"url": "ftp://example.com/a.png"}}, "invalid_image_url"),
    ({"type": "image_url", "image_url": {}}, None),
    ({"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF").decode(), "format": "wav"}},
     "unsupported_content"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AA=="}}, None),
]


@pytest.mark.parametrize(("part", "code"), BAD_PARTS)
def test_a_bad_part_is_a_400_naming_it(sup: SupervisorProcess, part: dict[str, Any], code: str | None) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look:"}, part]}]
    with pytest.raises(openai.BadRequestError) as info:
        ask(sup.openai(), "qwen2_vl", messages)
    error = info.value.body
    assert isinstance(error, dict) and error["param"] == "messages[0].content[1]", error
    if code is not None:
        assert error["code"] == code, error
    # The engine lives on: the next request answers.
    assert ask(sup.openai(), "qwen2_vl", image_message(png(1))).choices[0].finish_reason == "length"


def test_an_image_too_many_bytes_is_a_400(sup: SupervisorProcess) -> None:
    huge = "data:image/png;base64," + "A" * (28 << 20)  # 21 MiB decoded: over the 20 MiB an image may take
    with pytest.raises(openai.BadRequestError) as info:
        ask(sup.openai(), "qwen2_vl", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": huge}}]}])
    assert isinstance(info.value.body, dict) and info.value.body["code"] == "image_too_large"


def test_a_text_model_refuses_an_image_naming_the_part_and_the_model(sup: SupervisorProcess) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        ask(sup.openai(), "text", image_message(png(2)))
    error = info.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_content"
    assert "text" in error["message"] and "messages[0].content[0]" in error["message"]


def test_anthropic_and_responses_callers_hear_of_a_text_model_in_their_own_terms(sup: SupervisorProcess) -> None:
    import anthropic

    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(7)).decode()}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "shot:"},
                                                                     {"type": "image", "source": source}]}
    with pytest.raises(anthropic.BadRequestError) as info:
        sup.anthropic().messages.create(model="text", max_tokens=4, messages=[
            {"role": "user", "content": "Take a screenshot."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "shot", "input": {}}]},
            {"role": "user", "content": [result]}])
    body = info.value.body
    assert isinstance(body, dict) and "Model text does not take images (messages[2].content[0].content[1]" in \
        body["error"]["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        sup.openai().responses.create(model="text", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_uri(png(7))}]}])
    assert isinstance(refused.value.body, dict) and refused.value.body["param"] == "input[0].content[0]"


def test_several_images_in_one_message_each_take_their_tokens(sup: SupervisorProcess) -> None:
    client = sup.openai()
    one = ask(client, "gemma3", image_message(png(3)))
    two = ask(client, "gemma3", [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_uri(png(3))}},
        {"type": "image_url", "image_url": {"url": data_uri(png(4), "image/jpeg")}},
        {"type": "text", "text": "What is in this picture?"}]}])
    assert two.usage.prompt_tokens >= one.usage.prompt_tokens + 16
    # The first image is the same: its prefix is reused, up to where the second begins.
    assert two.usage.prompt_tokens_details.cached_tokens >= 16


def test_anthropic_image_blocks_answer_and_a_bad_one_is_an_anthropic_400(sup: SupervisorProcess) -> None:
    import anthropic

    client = sup.anthropic()
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png(5)).decode()}
    answer = client.messages.create(model="gemma3", max_tokens=6, messages=[
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "What is it?"}]}])
    prompt = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
    assert answer.stop_reason == "max_tokens" and prompt > 16
    counted = client.messages.count_tokens(model="gemma3", messages=[
        {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "What is it?"}]}])
    assert counted.input_tokens == prompt
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model="gemma3", max_tokens=6, messages=[{"role": "user", "content": [
            {"type": "image", "source": {**source, "data": base64.b64encode(b"garbage").decode()}}]}])
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"


def test_responses_input_image_answers(sup: SupervisorProcess) -> None:
    response = sup.openai().responses.create(model="qwen2_vl", max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "What is it?"},
                                     {"type": "input_image", "image_url": data_uri(png(6))}]}])
    assert response.status == "incomplete" and response.usage.input_tokens > 16


def test_ollama_images_answer_as_the_same_image_does_through_openai(sup: SupervisorProcess) -> None:
    import ollama

    image = png(8)
    via_openai = ask(sup.openai(), "qwen2_vl", image_message(image, "What is it?"), max_tokens=6)
    with ollama.Client(host=sup.url) as client:
        out = client.chat(model="qwen2_vl", messages=[{"role": "user", "content": "What is it?", "images": [image]}],
                          options={"temperature": 0, "num_predict": 6})
        assert out.message.content == via_openai.choices[0].message.content
        assert out.prompt_eval_count == via_openai.usage.prompt_tokens
        gen = client.generate(model="qwen2_vl", prompt="What is it?", images=[image],
                              options={"temperature": 0, "num_predict": 6})
        assert gen.response == out.message.content
        with pytest.raises(ollama.ResponseError) as info:
            client.chat(model="text", messages=[{"role": "user", "content": "x", "images": [image]}])
        assert info.value.status_code == 400 and "does not take images" in info.value.error


class ImageServer:
    """A local HTTP server: /a.png an image, /big a large one, /slow answers late, /moved redirects."""

    def __init__(self, image: bytes) -> None:
        import http.server
        import threading
        import time

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/slow":
                    time.sleep(3)
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", "/a.png")
                    self.end_headers()
                    return
                body = {"/a.png": image, "/slow": image, "/big": b"\0" * 300_000}.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def url_message(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this picture?"}]}]


def test_an_image_url_on_a_private_address_is_refused_by_default(sup: SupervisorProcess) -> None:
    server = ImageServer(png(0))
    try:
        for url in (server.url + "/a.png", server.url.replace("127.0.0.1", "localhost") + "/a.png"):
            with pytest.raises(openai.BadRequestError) as info:
                ask(sup.openai(), "qwen2_vl", url_message(url))
            error = info.value.body
            assert isinstance(error, dict) and error["code"] == "image_url_forbidden", error
            assert error["param"] == "messages[0].content[0]" and "image_fetch_private" in error["message"]
    finally:
        server.close()


def test_image_urls_are_fetched_with_a_deadline_and_a_size_cap(vlms: dict[str, Path], tmp_path: Path) -> None:
    server = ImageServer(png(0))
    settings = "[server]\nimage_fetch_private = true\nimage_fetch_timeout_s = 1\nimage_fetch_max_bytes = 100000\n"
    proc = SupervisorProcess(settings + config({"qwen2_vl": vlms["qwen2_vl"]}), tmp_path).wait_up()
    try:
        client = proc.openai()
        by_url = ask(client, "qwen2_vl", url_message(server.url + "/a.png"))
        inline = ask(client, "qwen2_vl", image_message(png(0)))
        assert token_ids(by_url) == token_ids(inline)  # the same bytes: the same image, the same cache entry
        assert inline.usage.prompt_tokens_details.cached_tokens == inline.usage.prompt_tokens - 1
        assert token_ids(ask(client, "qwen2_vl", url_message(server.url + "/moved"))) == token_ids(inline)
        source = {"type": "url", "url": server.url + "/a.png"}
        answer = proc.anthropic().messages.create(model="qwen2_vl", max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "Hi"}]}])
        assert answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0) > 16
        for path, code, words in (("/nothing", "invalid_image_url", "404"), ("/slow", "invalid_image_url", "within 1 s"),
                                  ("/big", "image_too_large", "100000-byte")):
            with pytest.raises(openai.BadRequestError) as info:
                ask(client, "qwen2_vl", url_message(server.url + path))
            error = info.value.body
            assert isinstance(error, dict) and error["code"] == code and words in error["message"], error
    finally:
        proc.stop()
        server.close()


def test_the_model_list_says_what_each_model_takes(sup: SupervisorProcess) -> None:
    models = {m.id: m.model_dump() for m in sup.openai().models.list().data}
    for family in FAMILIES:
        assert models[family]["context_window"] == 4096 and "vision" in models[family]["capabilities"]
    assert models["text"]["capabilities"] == ["completion"] and models["text"]["context_window"] == 4096


def test_mlxd_run_sends_the_image_files_a_prompt_names(sup: SupervisorProcess, tmp_path: Path) -> None:
    from tests.support import mlxd

    photo = tmp_path / "photo.png"
    photo.write_bytes(png(40))
    ask(sup.openai(), "qwen2_vl", [{"role": "user", "content": "Hi"}])  # its engine up, to read its counts
    before = sup.engine_stats("qwen2_vl")["tokens"]["prompt"]
    out = mlxd("run", "--url", sup.url, "qwen2_vl", f"What is in {photo}?", "--max-tokens", "3", "--temperature", "0")
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
    sent = sup.engine_stats("qwen2_vl")["tokens"]["prompt"] - before
    text_only = ask(sup.openai(), "qwen2_vl", [{"role": "user", "content": "What is in ?"}]).usage.prompt_tokens
    assert sent >= text_only + 16, (sent, text_only)
    missing = mlxd("run", "--url", sup.url, "text", f"What is in {photo}?", "--max-tokens", "3")
    assert missing.returncode == 1 and "does not take images" in missing.stderr


def test_mlxd_run_slash_image_attaches_to_the_next_message(sup: SupervisorProcess, tmp_path: Path) -> None:
    from tests.integration.test_run_cli import Chat

    photo = tmp_path / "shot.png"
    photo.write_bytes(png(41))
    ask(sup.openai(), "qwen2_vl", [{"role": "user", "content": "Hi"}])  # its engine up, to read its counts
    chat = Chat(sup, "qwen2_vl", "--temperature", "0", "--max-tokens", "3")
    chat.command(f"/image {tmp_path / 'nope.png'}", "no such file")
    chat.command(f"/image {photo}", "it goes with your next message")
    before = sup.engine_stats("qwen2_vl")["tokens"]
    chat.ask("Describe it.")
    after = sup.engine_stats("qwen2_vl")["tokens"]
    chat.ask("And again?")  # the image stays in the conversation: its prefix comes from the cache
    again = sup.engine_stats("qwen2_vl")["tokens"]
    assert after["prompt"] - before["prompt"] > 16
    assert again["cached"] - after["cached"] >= after["prompt"] - before["prompt"] - 1
    assert chat.bye() == 0


def test_without_the_vision_extra_a_vlm_fails_to_load_naming_it(vlms: dict[str, Path], tmp_path: Path) -> None:
    import os

    from tests.support import EngineProcess, engine_env

    # An mlx_vlm that cannot be imported shadows the installed one, as if the extra were missing.
    (tmp_path / "shadow" / "mlx_vlm").mkdir(parents=True)
    (tmp_path / "shadow" / "mlx_vlm" / "__init__.py").write_text("raise ImportError('no mlx_vlm here')\n")
    path = os.pathsep.join(p for p in (str(tmp_path / "shadow"), os.environ.get("PYTHONPATH")) if p)
    engine = EngineProcess(vlms["qwen2_vl"], "vlm", env=engine_env(PYTHONPATH=path))
    try:
        assert engine.proc.wait(60) == 4  # MODEL_LOAD_ERROR
        assert "install mlxd's `vision` extra" in engine.log()
    finally:
        engine.stop()


def test_a_text_model_never_imports_mlx_vlm(tiny_model: Path) -> None:
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from mlxd.engine.models.loaded_model import LoadedModel; "
            f"LoadedModel(Path({str(tiny_model)!r}), 'tiny'); print('mlx_vlm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"
