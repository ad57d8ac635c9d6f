"""Where criticalkv keeps what it installs and measures."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

CACHE_ENV_VAR = "CRITICALKV_CACHE_DIR"


def cache_root() -> Path:
    """``$CRITICALKV_CACHE_DIR`` if set, else the platform's user cache dir for ``criticalkv``."""
    env = os.environ.get(CACHE_ENV_VAR)
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("criticalkv"))
