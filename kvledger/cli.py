"""`kvledger ...`: the command line.

Bad input exits 2 with one line on stderr (`kvledger: error: ...`), never a traceback.
With `--json`, a command prints exactly one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from kvledger.engine.threads import limit_spinning
from kvledger.util.output import (EXIT_INTERRUPTED, CliError, HelpFormatter, emit_json, examples, finite_float,
                                   loads_strict, to_devnull)

EXIT_USAGE = 2
# The product's command groups, which live with their packages; each module has `register(subparsers)`.
COMMAND_GROUPS = ("kvledger.store.cli", "kvledger.entrypoint.cli", "kvledger.entrypoint.up", "kvledger.engine.cli")


@dataclass(frozen=True, slots=True)
class Tool:
    """A command group above the product (DESIGN.md "Layout": the bench, and the demo that runs its simulator).
    The product imports nothing of it: this table is the one place that names it, and `main` imports its
    module only to run its command, once the modules it `needs` (the `bench` extra) are found."""

    module: str                   # has `register(subparsers)`
    help: str                     # its line in `kvledger --help`, as its module's own parser says it
    needs: tuple[str, ...] = ()   # modules of the `bench` extra it cannot run without


BENCH_EXTRA = "pip install 'kvledger[bench]'"
TOOLS = {
    "bench": Tool("kvledger.bench.cli", "benchmarks, each side by side with its baseline",
                  ("matplotlib", "zmq", "openai")),
    # the simulator on a server's trace: numpy only, so `GET /whatif` answers without the extra (a chart, --out,
    # needs matplotlib and says so)
    "whatif": Tool("kvledger.bench.whatif_cli", "the simulator on the server's own recorded traffic: hit rate and "
                   "TTFT with other settings, beside the live"),
    "demo": Tool("kvledger.demo.cli", "the main job on built-in examples"),
}

# Commands that write the ledgers, Redis's dump, logs or the cluster token: what they (and every child they
# start) create is the user's alone (files 0600, folders 0700), whatever umask they were started with.
PRIVATE_COMMANDS = frozenset({"serve", "entrypoint", "engine", "up", "store"})
PRIVATE_UMASK = 0o077


class _Parser(argparse.ArgumentParser):
    """argparse with one line on error, every default shown in `--help` (`HelpFormatter`) and finite
    floats: every `type=float` flag refuses nan and inf."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)
        self.register("type", float, finite_float)

    def error(self, message: str) -> NoReturn:
        _fail(f"{self.prog}: {message}")


def _fail(message: str, code: int = EXIT_USAGE) -> NoReturn:
    print(f"kvledger: error: {message}", file=sys.stderr)
    raise SystemExit(code)


def _console() -> Any:
    from rich.console import Console

    return Console()


def _spec(name: str):
    """A preset by name, or the spec of a model at a path (`registry.resolve`)."""
    from pathlib import Path

    from kvledger.core import ModelSpec

    try:
        return ModelSpec.preset(name)
    except ValueError as e:
        if not Path(name).exists():
            raise CliError(str(e)) from None
    from kvledger.engine.models.registry import cli_resolve

    return cli_resolve(name).spec


def _pairs(text: str, what: str) -> dict[str, float]:
    """'agent=0.5,chatbot=0.5' → {'agent': 0.5, 'chatbot': 0.5}."""
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        name, sep, value = part.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            out[name.strip()] = finite_float(value)
        except ValueError:
            raise CliError(f"{what}: expected NAME=NUMBER[,NAME=NUMBER...], got {text!r}") from None
    return out


# --- plan ------------------------------------------------------------------------

def cmd_plan(args: argparse.Namespace) -> None:
    from kvledger.core import Link, Traffic, plan
    from kvledger.core.plan import DEFAULT_TTL_DAYS, check_tokens
    from kvledger.util.render import plan_json, plan_table

    spec = _spec(args.model)
    try:
        check_tokens("--tokens", args.tokens)
        traffic = Traffic(requests_per_day=args.requests_per_day, reuse=args.reuse, output_tokens=args.output_tokens,
                          mix=_pairs(args.mix, "--mix"), ttl_days={**DEFAULT_TTL_DAYS, **_pairs(args.ttl, "--ttl")})
        rate = {} if args.prefill_tps is None else {"prefill_tokens_per_s": args.prefill_tps}
        link = Link.of(spec, fetch_bytes_per_s=args.fetch_gbps * 1e9, fetch_latency_s=args.fetch_latency_ms / 1e3,
                       **rate)
    except ValueError as e:
        raise CliError(str(e)) from None
    p = plan(spec, args.tokens, traffic, link, prefill_source="--prefill-tps" if rate else None)
    if args.json:
        emit_json(plan_json(p))
    else:
        plan_table(p, _console())


# --- diff ------------------------------------------------------------------------

def _read_prompt(arg: str, encode: Callable[[str], list[int]] | None) -> tuple[list[int], bool]:
    """A JSON list of token ids (inline or in a file) or a text file. Returns (tokens, was_text)."""
    if arg.lstrip().startswith("["):
        content = arg
    else:
        try:
            content = Path(arg).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CliError(f"{arg}: no such file (give a text file, or a JSON list of token ids)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise CliError(f"{arg}: cannot read ({e})") from None
    stripped = content.lstrip()
    if stripped.startswith("["):
        try:
            data = loads_strict(content)
        except ValueError as e:
            raise CliError(f"{arg}: not a JSON list of token ids ({e})") from None
        if not isinstance(data, list):
            raise CliError(f"{arg}: not a JSON list of token ids")
        for i, t in enumerate(data):
            if type(t) is not int or not 0 <= t < 2**32:
                raise CliError(f"{arg}: item {i} is {t!r}, not a token id (an integer in [0, 2**32))")
        return data, False
    if encode is None:
        raise CliError(f"{arg}: is text; a tokenizer is needed (--tokenizer)")
    return encode(content), True


def cmd_diff(args: argparse.Namespace) -> None:
    from kvledger.core import diff_prompts
    from kvledger.util.render import diff_json, diff_view

    spec = _spec(args.model)
    tok = None

    def encode(text: str) -> list[int]:
        nonlocal tok
        if tok is None:
            from kvledger.engine.models.registry import load_tokenizer
            from kvledger.engine.models.tokenizer import TokenizerError

            try:
                tok = load_tokenizer(args.tokenizer)
            except TokenizerError as e:
                raise CliError(str(e)) from None
        return tok.encode(text).ids

    a, _ = _read_prompt(args.a, encode)
    b, _ = _read_prompt(args.b, encode)
    d = diff_prompts(a, b, spec, args.namespace, args.namespace_b)
    decode = (lambda ids: tok.decode(ids, skip_special_tokens=False)) if tok is not None else None
    if args.json:
        emit_json(diff_json(d, a, b, spec.name, decode))
    else:
        diff_view(d, a, b, spec.name, _console(), decode)


# --- parser ----------------------------------------------------------------------

def build_parser(tools: Collection[str] = tuple(TOOLS)) -> argparse.ArgumentParser:
    """The command line: the product's commands, and the tools named in `tools` in full (`main` names the one its
    command runs, if any), the others by their line in `kvledger --help` only."""
    p = _Parser(prog="kvledger", description="kvledger: a shared, persistent KV-cache tier for LLM serving.",
                epilog=examples("kvledger demo", "kvledger serve", "kvledger COMMAND --help"))
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _plan_parser(sub)
    _diff_parser(sub)
    for name in COMMAND_GROUPS:
        importlib.import_module(name).register(sub)
    for name, tool in TOOLS.items():
        if name in tools:
            importlib.import_module(tool.module).register(sub)
        else:
            sub.add_parser(name, help=tool.help)
    return p


def _models() -> str:
    from kvledger.core import ModelSpec

    return ", ".join(ModelSpec.presets())


def _plan_parser(sub: argparse._SubParsersAction) -> None:
    from kvledger.core import DEFAULT_MODEL
    from kvledger.core.spec import PUBLISHED_MODEL

    pl = sub.add_parser("plan", help="capacity and bandwidth figures for a model and a prompt length",
                        description="Capacity and bandwidth figures of one prompt length: block and snapshot bytes, "
                        "the hit cap,\nstorage per day and per TTL class, fetch time, prefill time (first order) "
                        "and the break-even prefix.",
                        epilog=examples("kvledger plan --tokens 2048",
                                        f"kvledger plan --model {PUBLISHED_MODEL} --tokens 131072 --json"))
    pl.add_argument("--model", default=DEFAULT_MODEL, help=f"one of: {_models()}, or a model's path; the default is "
                    "serve's")
    pl.add_argument("--tokens", type=int, required=True, help="prompt length in tokens")
    pl.add_argument("--requests-per-day", type=float, default=100_000, help="requests of this length a day")
    pl.add_argument("--reuse", type=float, default=0.56, help="share of prompt tokens served from cache")
    pl.add_argument("--output-tokens", type=int, default=0, help="decode tokens stored per request")
    pl.add_argument("--mix", default="agent=0.5,chatbot=0.5", help="share of requests per TTL class")
    pl.add_argument("--ttl", default="", help="TTL days per class (default: agent=3,chatbot=7)")
    pl.add_argument("--fetch-gbps", type=float, default=10.0, help="storage → host GB/s of one engine (assumed)")
    pl.add_argument("--fetch-latency-ms", type=float, default=1.0, help="fixed cost of one fetch")
    pl.add_argument("--prefill-tps", type=float, default=None,
                    help="prefill tokens/s (default: the model's own rate, as its preset states it: DESIGN.md's "
                         "128K tokens in 13 s for V4, ~800 measured on the CPU reference engine for SmolLM2)")
    pl.add_argument("--json", action="store_true", help="print one JSON object")
    pl.set_defaults(func=cmd_plan)


def _diff_parser(sub: argparse._SubParsersAction) -> None:
    from kvledger.core import DEFAULT_MODEL

    df = sub.add_parser("diff", help="where two prompts diverge and how many blocks of B hit after A",
                        description="Where prompt B diverges from prompt A, which span differs, how many blocks of "
                        "B hit after A\nwas cached, and how many more would hit with the differing span moved to "
                        "the end.",
                        epilog=examples("kvledger diff a.txt b.txt", "kvledger diff '[1, 2, 3]' '[1, 2, 4]' --json"))
    df.add_argument("a", help="prompt A: a text file, or a JSON list of token ids (inline or in a file)")
    df.add_argument("b", help="prompt B, likewise")
    df.add_argument("--model", default=DEFAULT_MODEL, help=f"one of: {_models()}, or a model's path; the default is "
                    "serve's")
    df.add_argument("--tokenizer", default=DEFAULT_MODEL, help="for text prompts: a model's name (its tokenizer), a "
                    ".gguf or a tokenizer.json")
    df.add_argument("--namespace", default="default", help="namespace (tenant) A was cached in")
    df.add_argument("--namespace-b", default=None, help="namespace B is asked in (default: --namespace)")
    df.add_argument("--json", action="store_true", help="print one JSON object")
    df.set_defaults(func=cmd_diff)


def _tool_to_run(argv: Sequence[str]) -> tuple[str, ...]:
    """The tool whose command `argv` is (none: a product command); CliError when what it needs is not installed."""
    tool = TOOLS.get(argv[0]) if argv else None
    if tool is None:
        return ()
    missing = [name for name in tool.needs if importlib.util.find_spec(name) is None]
    if missing:
        raise CliError(f"`kvledger {argv[0]}` needs the bench extra (no module {', '.join(missing)}): {BENCH_EXTRA}")
    return (argv[0],)


def main(argv: Sequence[str] | None = None) -> int:
    """Every way out is one of: 0, a one-line error and 2 (bad input) or 1 (a bug), 130 (Ctrl-C, at any
    moment after this module's few imports), or the status a server's own stop chose (SystemExit)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    limit_spinning()   # before any command imports torch: its OpenMP runtime reads the setting once, as it loads
    try:
        args = build_parser(_tool_to_run(argv)).parse_args(argv)
        if args.command in PRIVATE_COMMANDS:
            os.umask(PRIVATE_UMASK)
        args.func(args)
    except CliError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        _fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:  # a closed pipe (kvledger ... | head) is not an error; exit normally, so that
        to_devnull(sys.stdout)  # finally blocks and atexit run (os._exit skipped them), without a second EPIPE
    except Exception as e:  # a bug: one line, unless asked for the traceback
        if os.environ.get("KVLEDGER_DEBUG"):
            raise
        _fail(f"internal error: {type(e).__name__}: {e} (KVLEDGER_DEBUG=1 shows the traceback)", 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
