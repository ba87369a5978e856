"""Live recovery: replica groups that survive the loss of one of them without a restart,
on torchft (``pip install 'ckpt[live]'``); see docs/elastic.md, "Live recovery".

- :class:`LiveTrainer` (:mod:`trainer.live.worker`): the training loop of one rank of a
  replica group (a group of one rank or several: :mod:`trainer.live.group`);
- :class:`LiveConfig` (:mod:`trainer.live.config`): the lighthouse, timeouts, quorum size,
  group size;
- :class:`LiveJob` (:mod:`trainer.live.supervisor`): the lighthouse and the groups on one
  machine, supervised; ``python -m trainer.live.supervisor``;
- :func:`start_lighthouse` (:mod:`trainer.live.lighthouse`): ``python -m
  trainer.live.lighthouse``.

Names are imported on first use, so the supervisor and the lighthouse start without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "EXIT_QUORUM_LOST": "trainer.live.config",
    "LIVE_KEY_ENV": "trainer.live.config",
    "LiveConfig": "trainer.live.config",
    "LiveJob": "trainer.live.supervisor",
    "LiveTrainer": "trainer.live.worker",
    "QuorumLostError": "trainer.live.worker",
    "run": "trainer.live.worker",
    "start_lighthouse": "trainer.live.lighthouse",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.live' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
