"""A DCP checkpoint of an FSDP2 model and its optimizer, written once for the folder."""

from __future__ import annotations

import pytest

from tests.interop import dcp_workers as w
from tests.support.ranks import run_ranks


@pytest.fixture(scope="package")
def fsdp_dcp(tmp_path_factory) -> tuple[str, dict]:
    """A DCP checkpoint written by ``dcp.save`` of an FSDP2 model + AdamW on 2 ranks, and
    every tensor of it, full."""
    path = str(tmp_path_factory.mktemp("dcp") / "step-7")
    return path, run_ranks(2, w.dcp_save, path)[0]
