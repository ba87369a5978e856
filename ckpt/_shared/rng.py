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
            state["cuda_device"] = torch.cuda.current_device()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"])
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            _set_cuda_states(list(state["cuda"]), state.get("cuda_device"))


def _set_cuda_states(states: list[torch.Tensor], saved_device: int | None) -> None:
    """Each visible device gets the saved state of its index. With another number of devices
    than the saver's (fewer visible: torch.cuda.set_rng_state_all would fail on an index
    out of range), the generator the saver drew from (its current device's) goes on
    drawing here, on this process's current device."""
    count = torch.cuda.device_count()
    for index, rng in enumerate(states[:count]):
        torch.cuda.set_rng_state(rng, index)
    if saved_device is not None and len(states) != count and 0 <= saved_device < len(states):
        torch.cuda.set_rng_state(states[saved_device], torch.cuda.current_device())
