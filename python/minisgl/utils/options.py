"""Options: the config dataclass fields that are also keywords of `LLM(...)` and, as
`--field-name`, flags of `python -m minisgl` (server/args.py builds the parser from them)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection, Mapping
from dataclasses import field, fields
from typing import Any


def option(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field with its help text; `flag`: add_argument keywords (`type` and `choices`
    check keywords too), `aliases` (other names: older ones, vLLM's, SGLang's) and `switches`
    (value-less flags that set one value, e.g. --enforce-eager for --cuda-graph-max-bs 0)."""
    return field(default=default, metadata={"help": help, **flag})


class OptionError(ValueError):
    """A bad value of the option `name` (the command line reports it against that flag)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def check_options(config: Any, skip: Collection[str] = ()) -> None:
    """OptionError for a field value that its flag's `choices` or `type` would refuse."""
    for f in fields(config):
        value, meta = getattr(config, f.name), f.metadata
        if value is None or f.name in skip:
            continue
        try:
            if "choices" in meta and value not in meta["choices"]:
                raise ValueError(f"expected one of {', '.join(meta['choices'])}")
            if "type" in meta:
                meta["type"](str(value))
        except (ValueError, argparse.ArgumentTypeError) as e:
            raise OptionError(f.name, f"invalid {f.name} {value!r}: {e}") from None


def split_options(options: Mapping[str, Any], *configs: type) -> list[dict[str, Any]]:
    """`options` shared out among the dataclasses `configs` by field name (one dict each);
    TypeError naming any option that none of them has."""
    names = [{f.name for f in fields(config)} for config in configs]
    if unknown := set(options).difference(*names):
        raise TypeError(f"unknown option(s): {', '.join(sorted(unknown))}")
    return [{k: v for k, v in options.items() if k in n} for n in names]


def number(value: str, cast: Callable[[str], Any], what: str) -> Any:
    try:
        return cast(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {value!r}") from None


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        n = number(value, int, "an integer")
        if n < lo or (hi is not None and n > hi):
            bounds = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {n}")
        return n

    return parse


def ratio(value: str) -> float:
    x = number(value, float, "a number")
    if not 0.0 < x <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return x
