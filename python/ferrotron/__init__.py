"""ferrotron's LLM training planner from Python.

>>> import ferrotron
>>> doc = ferrotron.plan(model="llama-3-8b", seq=4096, dp=8, zero=1, gpu="h100")
>>> doc["ranks"][0]["peak"]            # bytes, what `ferrotron plan --json` prints

Keywords are the flags of `ferrotron plan` / `ferrotron plan search` with `_` for `-`
(`grad_acc=8`, `pp_schedule="interleaved"`); `model` is a preset name, the path of a
config.json (or of a directory holding one), or a config.json as a dict; `config` is a TOML
file of settings, as `--config`. A keyword left as None is unset. Bad input raises ValueError
with the command line's one-line message.
"""

import json
import os

from . import _native

__all__ = ["plan", "search", "presets"]


def _keywords(kwargs):
    # Paths (pathlib.Path) are given as their text, as on the command line.
    def text(v):
        if isinstance(v, os.PathLike):
            return os.fspath(v)
        raise TypeError(f"{type(v).__name__} is not a setting")

    try:
        return json.dumps(kwargs, default=text, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"keywords: {e}") from None


def plan(**kwargs):
    """The memory plan, step time and fit verdict: `ferrotron plan --json` as a dict."""
    return json.loads(_native.plan(_keywords(kwargs)))


def search(**kwargs):
    """The layouts of `gpus` GPUs that fit, fastest first: `ferrotron plan search --json`."""
    return json.loads(_native.search(_keywords(kwargs)))


def presets():
    """The built-in models (`["models"]`), GPU kinds (`["gpus"]`), networks and the choices of
    every enumerated setting: what `ferrotron serve` answers at /api/presets."""
    return json.loads(_native.presets())
