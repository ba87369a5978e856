"""Model factories and loss functions for test_verify.py / test_cli.py (named by
``"tests.support.verify_workers:build_net"`` specs, so they must live in an importable module)."""

from __future__ import annotations

import torch


class Net(torch.nn.Module):
    """A small MLP; ``scale`` multiplies the output (to make a rerun differ on purpose)."""

    def __init__(self, hidden: int = 64, scale: float = 1.0) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, hidden)
        self.fc2 = torch.nn.Linear(hidden, 4)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x))) * self.scale


def build_net() -> Net:
    """The factory a probe records: fresh weights (seed 123, unlike the saved ones)."""
    torch.manual_seed(123)
    return Net()


def build_scaled() -> Net:
    """Same weights as saved, output 1% off: outside every default tolerance."""
    return Net(scale=1.01)


def build_nudged() -> Net:
    """Same weights as saved, output 1e-6 relative off: inside the fp32 tolerance."""
    return Net(scale=1.0 + 1e-6)


def build_wider() -> Net:
    """Another architecture: does not fit the checkpoint."""
    return Net(hidden=65)


def build_bf16() -> Net:
    return Net().to(torch.bfloat16)


def mse_loss(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def doubled_loss(output: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return 2 * output.square().mean()

