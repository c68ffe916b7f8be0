"""The engine's flags are declared once, in EngineConfig's field metadata: every command that
runs the engine offers each of them, typer parses them into the EngineConfig the command
gets, and a bad value is a usage error naming its flag."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest
import typer
from typer.testing import CliRunner

from nanokv_cli.cli import app
from nanokv_cli.commands.engine_options import EngineFlags, engine_options
from nanokv_cli.commands.option_groups import sampling_options
from nanokv_cli.engine.config import EngineConfig, available_cpus
from nanokv_cli.engine.sampling_params import SamplingParams

runner = CliRunner()
FLAGS = {f.name: f.metadata["flag"] for f in fields(EngineConfig) if "flag" in f.metadata}


def help_text(*command: str) -> str:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    return " ".join(result.output.replace("│", " ").split())


def test_every_engine_flag_is_on_every_command_that_runs_the_engine():
    assert len(FLAGS) >= 14 and FLAGS["enable_prefix_caching"] == "--no-prefix-cache"
    for command in ("generate", "serve", "replay"):
        text = help_text(command)
        for flag in FLAGS.values():
            assert f"{flag} " in text, (command, flag)
    # inspect and advise take the cache layout only.
    assert "--prefix-match" in help_text("inspect") and "--threads" not in help_text("inspect")
    assert "--no-prefix-cache" in help_text("advise") and "--dtype" not in help_text("advise")


def test_serve_keeps_its_own_step_latency_default():
    target = "so streams never freeze behind a burst of prompts; 0: up to the token budget."
    assert f"{target} [default: 200]" in help_text("serve")
    assert f"{target} [default: off]" in help_text("generate")


def test_the_command_gets_the_engine_config_of_its_flags():
    got = {}

    @sampling_options("Most tokens.")
    @engine_options(defaults={"step_latency_target_ms": 200.0})
    def command(name: str = "x", *, engine: EngineFlags, sampling: SamplingParams) -> None:
        got.update(config=engine.config(), given=dict(engine.given), sampling=sampling)

    demo = typer.Typer()
    demo.command()(command)
    demo.command("other")(lambda: None)  # two commands: `command` is a subcommand

    def run(*args: str) -> typer.testing.Result:
        return runner.invoke(demo, ["command", *args], env={"COLUMNS": "300"})

    assert run().exit_code == 0
    assert got["config"] == EngineConfig(step_latency_target_ms=200.0) and got["given"] == {}
    args = ["--kv-cache-memory", "2GiB", "--no-prefix-cache", "--prefix-match", "block"]
    args += ["--dtype", "bfloat16", "--device", "cuda:1", "--max-num-seqs", "3"]
    args += ["--step-latency-target-ms", "0", "--threads", "1", "--max-tokens", "7"]
    assert run(*args).exit_code == 0, run(*args).output
    config = got["config"]
    assert config.kv_cache_memory == 2 * 2**30 and not config.enable_prefix_caching
    assert (config.prefix_match, config.dtype, config.device) == ("block", "bfloat16", "cuda:1")
    assert (config.max_num_seqs, config.step_latency_target_ms, config.threads) == (3, 0, 1)
    assert config.block_size == EngineConfig.block_size  # not given: EngineConfig's default
    assert got["sampling"].max_tokens == 7
    for args, flag, says in [
        (["--prefix-match", "tokens"], "--prefix-match", "choose from token, block"),
        (["--quantization", "int3"], "--quantization", "choose from auto, none, int8, int4"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory", "expected a size such as 512MiB"),
        (["--device", "tpu"], "--device", "expected cpu, cuda or cuda:N"),
        (["--block-size", "0"], "'--block-size'", "greater than or equal to 1"),
        (["--threads", str(available_cpus() + 1)], "--threads", "use at most"),
        (["--top-p", "2"], "'--top-p'", ""),
    ]:
        result = run(*args)
        text = " ".join(result.output.replace("│", " ").split())
        assert result.exit_code == 2 and f"Invalid value for {flag}: " in text, text
        assert says in text, text


def test_a_flag_reaches_the_engine_a_replay_runs(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt_token_ids": [1] * 40}) + "\n" for _ in range(3)))
    args = ["replay", str(path), "--dry-run", "--block-size", "8", "--json"]
    token = json.loads(runner.invoke(app, args).stdout)
    block = json.loads(runner.invoke(app, [*args, "--prefix-match", "block"]).stdout)
    off = json.loads(runner.invoke(app, [*args, "--no-prefix-cache"]).stdout)
    assert (token["prefix_match"], block["prefix_match"]) == ("token", "block")
    assert token["prefix_caching"] and not off["prefix_caching"] and off["cache_hits"] == 0
    assert block["cache_hits"] > 0


@pytest.mark.parametrize("bad", [{"only": ["blocksize"]}, {"defaults": {"nope": 1}}])
def test_a_setting_without_a_flag_is_refused_when_the_command_is_built(bad):
    with pytest.raises(ValueError, match="no engine flag"):
        engine_options(**bad)
