"""Test hooks: the one place where production code asks whether a test wants something unusual.

Some tests must make a child process (a torchrun rank, a curation task's worker process, a Slurm job) do
something at an exact point: signal itself in the middle of step N, not see ``latest`` on a "stale" shared
filesystem, split a small pool into several blocks. They ask through ONE environment variable,
``DINOPIPE_DEBUG_HOOKS``, read here and nowhere else (docs/reliability.md, "Test hooks")::

    DINOPIPE_DEBUG_HOOKS="signal=step:4:TERM;stale_latest=1"

``key=value`` pairs separated by ``;`` (the keys are :data:`HOOKS`; an unknown key is an error, so a typo
does not silently test nothing). Unset, every hook is off and a run behaves as it always does.

Why an environment variable and not a config key: the processes that need a hook are started by launchers
(torchrun, srun, a process pool, ``sbatch --export``), which pass the environment on without any plumbing,
and a config key would put test-only fields into every user-facing schema and every saved ``config.yaml``.
Why one variable: one name to document, grep for and keep out of a real job's environment.
"""

from __future__ import annotations

import os
from typing import Optional

ENV = "DINOPIPE_DEBUG_HOOKS"

HOOKS = {
    "signal": "``step|save|wait:N[:SIG][@RANK]`` (comma-separated): the process signals its own process group in "
              "the middle of step N or during the checkpoint save of step N, or waits at step N for a signal "
              "from outside (dinopipe/train/signals.py)",
    "stale_latest": "RANK: that rank does not see the checkpoint folder's ``latest`` pointer, as on a shared "
                    "filesystem with stale attribute caching (dinopipe/train/checkpoint.py)",
    "kill_task": "``[STEP/]FN[#N]:T[:start|end]``: task T of the N-th call (default the first) of curation task "
                 "function FN (in pipeline step STEP) SIGKILLs itself at its start or after it returned, as the OOM "
                 "killer would (curation/core/supervise.py; local and srun launchers)",
    "curate_block": "ROWS: rows per block of a curation step instead of 65536, so a small pool still splits "
                    "over several tasks (curation/core/runner.py; read when that module is imported)",
}


def parse(spec: str) -> dict[str, str]:
    """``"k=v;k2=v2"`` -> ``{"k": "v", "k2": "v2"}``; a key not in :data:`HOOKS` raises ``ValueError``."""
    out = {}
    for part in spec.split(";"):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in HOOKS:
            raise ValueError(f"{ENV}={spec!r}: {part.strip()!r} is not KEY=VALUE with KEY one of {sorted(HOOKS)}")
        out[key] = value.strip()
    return out


def get(key: str) -> Optional[str]:
    """The value a test set for hook ``key``, or None (always None in a real run)."""
    if key not in HOOKS:
        raise KeyError(f"no debug hook {key!r} (known: {sorted(HOOKS)})")
    spec = os.environ.get(ENV)
    return parse(spec).get(key) if spec else None


def env(**hooks: object) -> dict[str, str]:
    """The environment entry that turns ``hooks`` on in a child process (for tests):
    ``env(signal="step:2:TERM", stale_latest=1)``."""
    spec = ";".join(f"{k}={v}" for k, v in hooks.items())
    parse(spec)
    return {ENV: spec}


__all__ = ["ENV", "HOOKS", "get", "env", "parse"]
