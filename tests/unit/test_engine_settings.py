"""The engine's command line (mlxd/engine/settings.py): defaults and refusals."""

from __future__ import annotations

import pytest

from mlxd.engine.settings import parse_args

BASE = ["--model", "/m", "--model-id", "m", "--socket", "/tmp/s.sock"]


def test_gather_ms_defaults_to_5_and_0_turns_it_off() -> None:
    assert parse_args(BASE).gather_ms == 5.0
    assert parse_args([*BASE, "--gather-ms", "0"]).gather_ms == 0.0
    assert parse_args([*BASE, "--gather-ms", "2.5"]).gather_ms == 2.5


@pytest.mark.parametrize("value", ["-1", "1001", "soon"])
def test_a_bad_gather_ms_is_refused_with_a_message(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, "--gather-ms", value])
    assert exit_info.value.code == 2
    assert "--gather-ms" in capsys.readouterr().err


def test_prompt_cache_flags_default_to_the_machine_and_take_values() -> None:
    s = parse_args(BASE)
    assert (s.prompt_cache_bytes, s.ssd_cache_bytes, s.ssd_cache_dir, s.kv_bits, s.kv_group_size, s.write_behind) == (
        None, None, None, None, 64, True)
    s = parse_args([*BASE, "--prompt-cache-bytes", "0", "--ssd-cache-bytes", "0", "--kv-bits", "4",
                    "--kv-group-size", "32", "--ssd-write-behind", "off"])
    assert (s.prompt_cache_bytes, s.ssd_cache_bytes, s.kv_bits, s.kv_group_size, s.write_behind) == (0, 0, 4, 32, False)


@pytest.mark.parametrize(("flag", "value"), [
    ("--prompt-cache-bytes", "-1"), ("--ssd-cache-bytes", "-5"), ("--prompt-cache-bytes", "lots"),
    ("--kv-bits", "7"), ("--kv-group-size", "48"), ("--ssd-write-behind", "maybe"),
])
def test_bad_prompt_cache_flags_are_refused_with_a_message(flag: str, value: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, flag, value])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_generation_checkpoints_default_to_512_tokens_and_0_turns_them_off(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(BASE).generation_checkpoint == 512
    assert parse_args([*BASE, "--generation-checkpoint", "0"]).generation_checkpoint == 0
    for bad in ("-1", "often"):
        with pytest.raises(SystemExit) as exit_info:
            parse_args([*BASE, "--generation-checkpoint", bad])
        assert exit_info.value.code == 2
        assert "--generation-checkpoint" in capsys.readouterr().err


def test_the_solo_prefill_step_is_the_devices_unless_given() -> None:
    assert parse_args(BASE).solo_prefill_step is None  # the gateway picks it at load: 2048 on a GPU
    assert parse_args([*BASE, "--solo-prefill-step", "4096"]).solo_prefill_step == 4096


@pytest.mark.parametrize("value", ["0", "-5", "many"])
def test_a_bad_solo_prefill_step_is_refused_with_a_message(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, "--solo-prefill-step", value])
    assert exit_info.value.code == 2 and "--solo-prefill-step" in capsys.readouterr().err


def test_the_width_probe_is_auto_unless_given_and_refuses_other_words(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args(BASE).width_probe == "auto"  # on a GPU, at batch auto (loader.size_options)
    assert parse_args([*BASE, "--width-probe", "off"]).width_probe == "off"
    with pytest.raises(SystemExit) as exit_info:
        parse_args([*BASE, "--width-probe", "sometimes"])
    assert exit_info.value.code == 2 and "--width-probe" in capsys.readouterr().err
