"""The cached option names of vLLM's OpenAI server: what the pre-flight refuses without importing vLLM,
and what it leaves to vLLM's parser."""

from __future__ import annotations

import argparse

import pytest

from afd_mrv2.errors import AfdError
from afd_mrv2.serve import ServeOptions, build_plan
from afd_mrv2.serve import options as serve_options
from afd_mrv2.serve.app import check_option_names

OPTIONS = {
    "--dtype": True,
    "--max-model-len": True,
    "--enforce-eager": False,
    "--no-enforce-eager": False,
    "-O": True,
    "--compilation-config": True,
    "--api-key": True,
    "--seed": True,
}


@pytest.mark.parametrize(
    ("args", "bad"),
    [
        (["--dtype", "float32", "--max-model-len", "256"], []),
        (["--dtype=float32", "--enforce-eager", "--no-such-flag"], ["--no-such-flag"]),
        (["--max_model_len", "256", "--nope=1"], ["--nope=1"]),  # underscores read as dashes
        (["--seed", "-1", "--api-key", "-secret-"], []),  # values that start with '-'
        (["-O3", "--dtype", "half"], []),  # a short option with its value attached
        (["--max-model", "256", "--no-such-flag"], []),  # an abbreviation: left to vLLM, and what follows
        (["--compilation-config.mode", "3", "--nope"], []),  # vLLM's dotted syntax: left to vLLM
        (["--bogus", "x", "--other"], ["--bogus", "--other"]),
    ],
)
def test_only_certainly_unknown_options_are_found(args, bad) -> None:
    assert serve_options.unknown(args, OPTIONS) == bad


def test_the_cache_round_trips_per_vllm_version(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert serve_options.load("vllm-9.9.9") is None
    serve_options.write(OPTIONS, "vllm-9.9.9")
    assert serve_options.load("vllm-9.9.9") == OPTIONS
    assert serve_options.cache_file("vllm-9.9.9") == tmp_path / "afd-mrv2" / "vllm-9.9.9-serve-options.json"
    assert serve_options.load("vllm-9.9.10") is None  # another vLLM: its own options
    monkeypatch.setenv(serve_options.NO_CACHE_ENV, "1")
    assert serve_options.load("vllm-9.9.9") is None


def test_parser_options_reads_every_option_string_and_its_arity() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction)
    parser.add_argument("-O", "--optimization-level", type=int)
    found = serve_options.parser_options([parser])
    assert found["--dtype"] and found["-O"] and found["--optimization-level"]
    assert not found["--enforce-eager"] and not found["--no-enforce-eager"] and not found["-h"]


def test_the_preflight_refuses_a_cached_unknown_option_before_anything(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(serve_options, "load", lambda vllm=None: OPTIONS)
    plan = build_plan(ServeOptions(str(tmp_path), 1, 1, extra=("--dtype", "float32", "--no-such-flag")))
    with pytest.raises(AfdError, match=r"^not vLLM engine or server arguments: --no-such-flag \(see vllm serve"):
        check_option_names(plan)
    check_option_names(build_plan(ServeOptions(str(tmp_path), 1, 1, extra=("--dtype", "float32"))))
    monkeypatch.setattr(serve_options, "load", lambda vllm=None: None)  # no cache: vLLM's parser decides
    check_option_names(plan)
