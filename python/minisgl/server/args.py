"""`python -m minisgl`'s command line: a flag `--field-name` with its help for every option field
of the configs (the extensions' too). A bad value exits with code 2 and one line naming the flag."""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, dataclass, field, fields
from typing import Any, NoReturn

from minisgl.engine.config import EngineConfig
from minisgl.extension import ExtensionMissing, check_extension_options, extensions
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.options import OptionError, int_range, number, option, split_options


def seconds(value: str) -> float:
    """A finite number of seconds >= 0."""
    x = number(value, float, "seconds")
    if not 0 <= x < float("inf"):  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {value}")
    return x


@dataclass
class ServerArgs:
    engine: EngineConfig = field(default_factory=EngineConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    tp: int = option(
        1,
        "tensor-parallel size (GPUs)",
        type=int_range(1),
        aliases=["--tensor-parallel-size", "--tp-size"],  # vLLM's, SGLang's
    )
    host: str = option("127.0.0.1", "HTTP bind address")
    port: int = option(1919, "HTTP port", type=int_range(1, 65535))
    num_tokenizer: int = option(1, "tokenizer worker processes", type=int_range(1))
    served_model_name: str | None = option(
        None, "model id that /v1/models lists and requests may name (unset: the --model value)"
    )
    shell: bool = option(False, "interactive terminal chat instead of a server")
    shutdown_timeout: float = option(
        30.0, "seconds SIGTERM waits for in-flight requests to finish", type=seconds
    )
    log_level: str = option(
        "info",
        "logging level of every process",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
    )

    # the extensions' own options (`Extensions.options`), by extension: each its dataclass
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, options in extensions().options.items():  # defaults for those not given
            self.extras.setdefault(name, options())
            if (check := getattr(self.extras[name], "check", None)) is not None:
                check(self)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Just the one line (argparse would print the whole usage block first); exit code 2.
        if message.startswith("unrecognized arguments"):
            try:  # a flag of an extension missing here: say which
                check_extension_options(message.split(":", 1)[1].split(), flag=True)
            except ExtensionMissing as e:
                message = str(e)
            else:
                if not extensions().options:
                    message += " (the extensions' flags need minisgl/ext, which is not loaded)"
        self.exit(2, f"{self.prog}: error: {message}\n")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def option_error(e: OptionError) -> str:
    """An OptionError as the command line reports it: against its flag."""
    return f"argument {_flag(e.name)}: {e}"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Lists a flag's aliases in its own entry: `--tp, --tensor-parallel-size, --tp-size TP`."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        aliases = getattr(action, "aliases", [])
        if not aliases:
            return super()._format_action_invocation(action)
        names = ", ".join([*action.option_strings, *aliases])
        if action.nargs == 0:
            return names
        metavar = self._get_default_metavar_for_optional(action)
        return f"{names} {self._format_args(action, metavar)}"


# The --help group of a flag, by what a user wants to do; any other goes to its config's:
# EngineConfig's to engine, SchedulerConfig's to scheduler, ServerArgs' to server.
_GROUPS = {EngineConfig: "engine", SchedulerConfig: "scheduler", ServerArgs: "server"}
_GROUP_OF = {
    "model": "model dtype max_model_len dummy_weights seed served_model_name".split(),
    "engine": ["tp"],
    "scheduler": ["max_running_requests"],
}
HELP_GROUPS = ("model", "engine", "scheduler", "server")


def _add_flag(parser: argparse._ActionsContainer, f: Field[Any]) -> None:
    kwargs = dict(f.metadata)
    aliases, switches = kwargs.pop("aliases", []), kwargs.pop("switches", {})
    if f.default is False:
        kwargs["action"] = "store_true"
    action = parser.add_argument(_flag(f.name), dest=f.name, default=f.default, **kwargs)
    action.aliases = aliases  # type: ignore[attr-defined]  # for _HelpFormatter
    for alias in aliases:  # a flag of its own, so that its errors name it; --help: in the entry
        kwargs["help"] = argparse.SUPPRESS
        parser.add_argument(alias, dest=f.name, default=argparse.SUPPRESS, **kwargs)
    for switch, value in switches.items():
        help = f"same as {_flag(f.name)} {value}"
        const = {"action": "store_const", "const": value, "help": help}
        parser.add_argument(switch, dest=f.name, default=argparse.SUPPRESS, **const)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m minisgl",
        usage="%(prog)s [--model MODEL] [--shell] [OPTIONS]",  # the groups below list them all
        description="minisgl: OpenAI-compatible LLM server (or --shell for a terminal chat).",
        allow_abbrev=False,  # a typo must not silently match another flag
        formatter_class=_HelpFormatter,
    )
    groups = {title: parser.add_argument_group(title) for title in HELP_GROUPS}
    group_of = {name: title for title, names in _GROUP_OF.items() for name in names}
    for config, title in _GROUPS.items():
        for f in fields(config):
            if "help" in f.metadata:  # not ServerArgs.engine / .scheduler / .extras
                _add_flag(groups[group_of.get(f.name, title)], f)
    exts = extensions()
    for name in {**exts.scheduler_options, **exts.options}:  # their own groups
        group = parser.add_argument_group(f"{name} extension")
        for options in (exts.scheduler_options.get(name), exts.options.get(name)):
            for f in fields(options) if options is not None else ():
                _add_flag(group, f)
    return parser


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse `argv` (sys.argv[1:] when None); exits with code 2 on a bad or unknown flag.
    ValueError: options this machine cannot run (e.g. --moe-backend triton without CUDA)."""
    parser = build_parser()
    options = vars(parser.parse_args(argv))
    extras, own_sched = extensions().options, extensions().scheduler_options.values()
    sched_names = {f.name for config in (SchedulerConfig, *own_sched) for f in fields(config)}
    scheduler = {k: options.pop(k) for k in list(options) if k in sched_names}
    configs = (EngineConfig, ServerArgs, *extras.values())
    engine, server, *own = split_options(options, *configs)
    if "serving" not in extras and os.environ.get("MINISGL_API_KEY"):  # never serve it open
        parser.error(str(ExtensionMissing("MINISGL_API_KEY", "serving")))
    try:
        server["extras"] = {name: cls(**o) for (name, cls), o in zip(extras.items(), own)}
        sched = SchedulerConfig.from_options(scheduler)
        return ServerArgs(EngineConfig(**engine), sched, **server)
    except OptionError as e:  # a check only the config makes, e.g. the --attn names
        parser.error(option_error(e))
