"""Optional packages of the envs extra, imported where a job asks for them."""

from __future__ import annotations

import importlib

from ..errors import HpcRlError


def import_extra(module: str, key: str, needs: str, error: type[HpcRlError]):
    """`module` imported, or `error` naming `key` and the flag that installs it: "KEY: NEEDS the PACKAGE ..."."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise error(f"{key}: {needs}; run ./install.sh --envs (or pip install 'hpc-rl[envs]')") from None
