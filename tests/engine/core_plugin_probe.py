"""A core plugin for tests/engine/test_core_plugins.py: says where it ran and what it was given."""

from __future__ import annotations

import json
import os


def record(core) -> None:
    """Writes this process's pid and parent, and the core's model and KV blocks, to
    ``$SIGHTLINE_TEST_PLUGIN_OUT``."""
    with open(os.environ["SIGHTLINE_TEST_PLUGIN_OUT"], "w") as out:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "model": core.model_name,
                   "kv_blocks": core.runner.num_blocks}, out)
