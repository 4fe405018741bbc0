"""``kvplane generate``: JSON and text output, step-size invariance, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvplane.apps.generate import parse_prompt_ids
from kvplane.cli import main
from kvplane.models import load_model, save_checkpoint, tiny_config


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict[str, list[int]]:
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON line
    result: dict[str, list[int]] = json.loads(out)
    return result


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek"])
def test_json_tokens_match_the_library(capsys: pytest.CaptureFixture[str], name: str) -> None:
    want = list(load_model(name).generate([1, 2, 3, 4, 5], 6).tokens)
    base = ["generate", "--model", name, "--prompt-ids", "1,2,3,4,5", "--max-new-tokens", "6"]
    assert _json(capsys, [*base, "--json"]) == {"tokens": want}
    assert _json(capsys, [*base, "--json", "--step-size", "2", "--block-size", "4"]) == {
        "tokens": want
    }


def test_text_output_and_a_checkpoint_dir(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    save_checkpoint(tiny_config("tiny-llama"), tmp_path, seed=0)
    want = load_model("tiny-llama").generate([7, 8], 3).tokens
    assert (
        main(
            ["generate", "--model", str(tmp_path), "--prompt-ids", "7, 8", "--max-new-tokens", "3"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out
    assert out.strip().splitlines()[-1] == "tokens: " + " ".join(map(str, want))


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--prompt-ids", "1,x"], "--prompt-ids entry 1 ('x') is not an integer token id"),
        (
            ["--prompt-ids", "1,5000"],
            "prompt token id 5000 at position 1 is outside the vocabulary",
        ),
        (["--prompt-ids", "1", "--model", "tiny-gpt"], "neither an embedded model"),
        (["--prompt-ids", "1", "--max-new-tokens", "-2"], "max_new_tokens must be an int >= 0"),
    ],
)
def test_bad_input_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: str
) -> None:
    assert main(["generate", *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("kvplane: error: ") and words in err


def test_unsupported_checkpoint_architecture(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    save_checkpoint(tiny_config("tiny-llama"), tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(tmp_path), "--prompt-ids", "1"]) == 1
    assert "'GPT2LMHeadModel' is not supported" in capsys.readouterr().err


def test_parse_prompt_ids() -> None:
    assert parse_prompt_ids(" 3,4 ,5") == [3, 4, 5]


def test_attention_flag_chooses_the_backends(capsys: pytest.CaptureFixture[str]) -> None:
    want = list(load_model("tiny-deepseek").generate([1, 2, 3, 4, 5], 4).tokens)
    base = ["generate", "--model", "tiny-deepseek", "--prompt-ids", "1,2,3,4,5"]
    base += ["--max-new-tokens", "4"]
    named = [*base, "--json", "--attention", "torch_splitkv,mha"]  # one per kind planned
    assert _json(capsys, named) == {"tokens": want}
    assert main([*base, "--attention", "measured"]) == 0
    assert "attention: measured -> " in capsys.readouterr().out
    assert main([*base, "--attention", "sdpa"]) == 1  # prefill's mla_mha kind: never substituted
    assert "backend 'sdpa' cannot run this problem: kind mla_mha" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--attention", "torch,fastest"])
    assert "attention must be auto or measured or backend names" in capsys.readouterr().err
