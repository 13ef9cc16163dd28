"""The real `kvchat` command in a subprocess, run by a fresh user."""

from __future__ import annotations

import os
import sys

KVCHAT = [sys.executable, "-m", "kvchat"]


def user_env(home) -> dict[str, str]:
    """A fresh user (no config, no history) who shares this machine's converted model cache."""
    from kvchat.models.packaged import cache_dir

    env = {**os.environ, "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config")}
    env["KVCHAT_CACHE_DIR"] = str(cache_dir())
    env.pop("KVCHAT_CONFIG", None)
    return env
