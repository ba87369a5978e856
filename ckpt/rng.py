"""RNGState: the random generators a training step draws from, as one stateful item."""

from __future__ import annotations

import random
from typing import Any

import torch


class RNGState:
    """Captures and restores Python's, NumPy's (when installed), torch's CPU and CUDA RNGs.

    Put it in the state (``{"rng": ckpt.RNGState(), ...}``): its state is read at save time
    and the generators are reset at restore, so dropout and sampling resume bit-exactly.
    Saved per rank: on another world size rank r gets saved rank ``r % saved_world``'s state.
    """

    ckpt_per_rank = True

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy as np

            state["numpy"] = np.random.get_state(legacy=False)
        except ImportError:
            pass
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
