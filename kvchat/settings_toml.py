"""configs/default.toml, written from the settings' declarations (scripts/make_default_toml.py writes
both copies; a test checks that the shipped files equal what this makes)."""

from __future__ import annotations

import textwrap

from kvchat.config import format_value
from kvchat.settings_schema import all_settings
from kvchat.settings_spec import SettingInfo

WIDTH = 108  # of a comment line

HEADER = """\
# kvchat's defaults, written from kvchat/settings_schema.py by scripts/make_default_toml.py (do not edit
# by hand). Copy any key into ~/.config/kvchat/config.toml (or $KVCHAT_CONFIG) to change it; command-line
# flags and `/set table.key value` override both. Unknown tables or keys are an error.
"""


def help_with_limits(info: SettingInfo) -> str:
    """The setting's help with its valid range and what a special value means: `... (>= 0; 0 is greedy).`"""
    extra = [str(info.spec.range)] if info.spec.range else []
    extra += [info.spec.note] if info.spec.note else []
    help = info.spec.help
    return f"{help.removesuffix('.')} ({'; '.join(extra)})." if extra else help


def render_default_toml() -> str:
    """Every setting with its comment and default; one unset by default is shown commented out."""
    out = [HEADER]
    table = None
    for info in all_settings().values():
        if info.table != table:
            table = info.table
            out.append(f"\n[{table}]\n")
        text = help_with_limits(info) + (f" {info.spec.detail}" if info.spec.detail else "")
        out += [line + "\n" for line in _comment(text)]
        if info.default is None:
            out.append(f"# {info.name} = {format_value(info.spec.example)}\n")
        else:
            out.append(f"{info.name} = {format_value(info.default)}\n")
    return "".join(out)


def _comment(text: str) -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent="# ", subsequent_indent="# ", break_on_hyphens=False)
