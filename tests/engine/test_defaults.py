"""engine/defaults.py: one table of the serving defaults, which every command's flags, every config record and
`Engine` read; and `--store-capacity SIZE`, the one spelling of a store's capacity, on every command that takes
one (a capacity flag takes a size with its unit, never names the unit: `up --juicefs-capacity SIZE` too)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect

import pytest

from kvledger.engine.defaults import DEFAULTS, Defaults

REDIS = ["--redis-url", "redis://127.0.0.1:1/0", "--data-dir", "/nonexistent"]
MINIMAL = {   # the shortest command line of each serving command
    "serve": ["serve"],
    "entrypoint": ["entrypoint", *REDIS],
    "engine": ["engine", "--role", "both", *REDIS],
    "up": ["up"],
}
GRACE = {"serve": "serve_grace_s", "entrypoint": "serve_grace_s", "engine": "engine_grace_s", "up": "up_grace_s"}
OWN = {   # a flag named like a table field that deliberately defaults to something else, and why
    ("engine", "port"): 0,                  # an engine's internal API: any free port
    ("entrypoint", "gc_interval_s"): 0.0,   # the engines' puts keep a cluster's store; the entrypoint runs no GC
    ("serve", "kv_cache_bytes"): None,      # None: `Engine`'s default, which is the table's
    ("entrypoint", "kv_cache_bytes"): None,
}
CARRIES = {   # table fields each command must have a flag (or a set default) for: a renamed flag fails here
    "serve": {"host", "port", "max_num_seqs", "checkpoint_every", "stream_hits", "routing", "max_body_bytes",
              "max_tokens_limit", "status_interval_s", "gc_interval_s", "trace_file_bytes", "trace_files"},
    "entrypoint": {"host", "port", "max_num_seqs", "checkpoint_every", "stream_hits", "routing", "max_body_bytes",
                   "max_tokens_limit", "status_interval_s", "trace_file_bytes", "trace_files"},
    "engine": {"host", "max_num_seqs", "checkpoint_every", "stream_hits"},
    "up": {"host", "port", "max_num_seqs", "checkpoint_every", "stream_hits", "routing", "max_body_bytes",
           "max_tokens_limit", "status_interval_s", "trace_file_bytes", "trace_files"},
}


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from kvledger.cli import build_parser

    return build_parser(())   # the product's commands


@pytest.mark.parametrize("command", list(MINIMAL))
def test_every_flag_default_is_the_tables(parser, command):
    args = vars(parser.parse_args(MINIMAL[command]))
    fields = {f.name for f in dataclasses.fields(Defaults)}
    assert CARRIES[command] <= set(args), f"kvledger {command} lost a flag: {CARRIES[command] - set(args)}"
    got = {name: args[name] for name in fields & set(args)}
    want = {name: OWN.get((command, name), getattr(DEFAULTS, name)) for name in got}
    assert got == want
    assert args["grace_s"] == getattr(DEFAULTS, GRACE[command])


def test_the_config_records_and_the_engine_default_to_the_table():
    from kvledger.engine.engine import Engine
    from kvledger.engine.process import EngineConfig
    from kvledger.entrypoint.config import ServeConfig, TraceSettings

    def defaults(record: type) -> dict:
        return {f.name: f.default for f in dataclasses.fields(record)}

    serve, engine, trace = defaults(ServeConfig), defaults(EngineConfig), defaults(TraceSettings)
    for name in ("host", "port", "max_body_bytes", "max_tokens_limit", "max_num_seqs", "device", "checkpoint_every",
                 "gc_interval_s", "routing"):
        assert serve[name] == getattr(DEFAULTS, name), name
    assert (serve["status_every_s"], serve["max_concurrent_per_key"]) == (DEFAULTS.status_interval_s,
                                                                          DEFAULTS.open_per_key)
    for name in ("host", "max_num_seqs", "device", "checkpoint_every"):
        assert engine[name] == getattr(DEFAULTS, name), name
    assert engine["grace_s"] == DEFAULTS.engine_grace_s
    assert (trace["file_bytes"], trace["files"]) == (DEFAULTS.trace_file_bytes, DEFAULTS.trace_files)
    params = inspect.signature(Engine.__init__).parameters
    for name in ("device", "max_num_seqs", "max_num_batched_tokens", "kv_cache_bytes", "checkpoint_every"):
        assert params[name].default == getattr(DEFAULTS, name), name


def test_the_per_key_limit_follows_the_batch():
    from kvledger.entrypoint.config import per_key_default

    assert per_key_default(DEFAULTS.max_num_seqs, keyed=True) == DEFAULTS.max_num_seqs // 2
    assert per_key_default(DEFAULTS.max_num_seqs, keyed=False) == DEFAULTS.open_per_key


def _options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(command, option string) of every option of every subcommand, depth first."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, (*path, name))
        else:
            yield from ((" ".join(path), o) for o in action.option_strings)


def test_store_gc_takes_a_store_capacity_as_serve_does(parser):
    from kvledger.store.cli import cli_capacity
    from kvledger.util.output import CliError

    takes = {c for c, o in _options(parser) if o == "--store-capacity"}
    assert {"serve", "entrypoint", "engine", "up", "store gc"} <= takes
    args = parser.parse_args(["store", "gc", "--store-capacity", "50G"])
    assert cli_capacity(args.store_capacity) == 50 * 10**9
    assert cli_capacity("inf") is None and cli_capacity("1") == 1
    for text, says in (("lots", "expected a size"), ("0.5", "one byte"), ("2e18", "exabyte")):
        with pytest.raises(CliError, match=says):
            cli_capacity(text)


def test_no_capacity_flag_names_its_unit():
    from kvledger.cli import build_parser

    options = list(_options(build_parser()))   # the tools too
    assert not [(c, o) for c, o in options if o in ("--capacity-gb", "--juicefs-capacity-gib")]
    assert not [(c, o) for c, o in options if "capacity" in o and not o.endswith("capacity")]


def test_up_rounds_the_juicefs_capacity_up_to_whole_gib(parser):
    from kvledger.entrypoint.up import juicefs_gib
    from kvledger.util.output import CliError

    args = parser.parse_args(["up", "--juicefs-capacity", "1.5GiB"])
    assert juicefs_gib(args.juicefs_capacity) == 2   # juicefs's own --capacity takes whole GiB
    assert (juicefs_gib("1GiB"), juicefs_gib("1"), juicefs_gib(None), juicefs_gib("inf")) == (1, 1, 0, 0)
    for text, says in (("lots", "expected a size"), ("0.5", "one byte"), ("2e18", "exabyte")):
        with pytest.raises(CliError, match=says):
            juicefs_gib(text)
