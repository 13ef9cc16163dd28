"""Write configs/default.toml and the packaged copy, kvchat/configs/default.toml, from the settings'
declarations in kvchat/settings_schema.py. Run after changing a setting: python scripts/make_default_toml.py
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvchat.settings_toml import render_default_toml

ROOT = Path(__file__).resolve().parent.parent
TARGETS = (ROOT / "configs" / "default.toml", ROOT / "kvchat" / "configs" / "default.toml")


def main() -> None:
    formatter = argparse.RawDescriptionHelpFormatter
    argparse.ArgumentParser(description=__doc__, formatter_class=formatter).parse_args()
    text = render_default_toml()
    for path in TARGETS:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
