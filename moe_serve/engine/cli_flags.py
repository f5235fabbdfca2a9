"""What moe-serve's and moe-generate's flags share beyond argparse: help that shows every default,
a value for every flag from an environment variable MOE_ARG_<FLAG_NAME> (llama.cpp's habit), and
the argument types both use.

The environment is read generically over the parser's actions, so a flag added anywhere gets its
variable with no extra work. Environment values go in front of the command line, so the command line
(and a --config file placed between the two) overrides them.
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

ENV_PREFIX = "MOE_ARG_"
ENV_HELP = (f"Every flag can also be set as an environment variable {ENV_PREFIX}<FLAG_NAME> (--max-model-len: "
            f"{ENV_PREFIX}MAX_MODEL_LEN; switches take 1/0); the command line wins.")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off", ""}


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's formatter that appends "(default: X)", except where the help already says what the
    default is in words (a None default means "computed", and the help must say how)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or "default" in text or action.default is argparse.SUPPRESS:
            return text
        return super()._get_help_string(action)


def env_name(action: argparse.Action) -> str | None:
    """--gpu-expert-budget -> MOE_ARG_GPU_EXPERT_BUDGET; None for positionals, --help and --version."""
    longs = [opt for opt in action.option_strings if opt.startswith("--")]
    if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    return ENV_PREFIX + longs[0][2:].replace("-", "_").upper()


def env_argv(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> list[str]:
    """The MOE_ARG_* variables set in environ, as the flags they stand for (argparse then checks them)."""
    environ = os.environ if environ is None else environ
    argv: list[str] = []
    for action in parser._actions:
        name = env_name(action)
        if name is None or name not in environ:
            continue
        flag, value = next(opt for opt in action.option_strings if opt.startswith("--")), environ[name]
        if action.nargs == 0:
            argv += _switch(parser, name, action, value)
        elif action.nargs in ("+", "*") or isinstance(action, argparse._AppendAction):
            items = [item.strip() for item in value.split(",") if item.strip()]
            argv += [flag, *items] if action.nargs in ("+", "*") else [a for i in items for a in (flag, i)]
        else:
            argv += [flag, value]
    return argv


def _switch(parser: argparse.ArgumentParser, name: str, action: argparse.Action, value: str) -> list[str]:
    word = value.strip().lower()
    if word not in _TRUE | _FALSE:
        parser.error(f"{name}={value!r}: {action.option_strings[0]} is a switch; use 1/true/yes/on or 0/false/no/off")
    if word in _TRUE:
        return [action.option_strings[0]]
    # --flag/--no-flag pairs can be switched off explicitly; a plain switch off is its default
    return action.option_strings[1:2] if isinstance(action, argparse.BooleanOptionalAction) else []


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value
