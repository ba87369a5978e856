"""The forward level's figures never claim agreement that NaN hides: an all-NaN output
fails and reports max |diff| nan (text and JSON)."""

from __future__ import annotations

import json

import torch

from tests.verify.test_verify import cli, make_net, save


def test_an_all_nan_output_fails_and_reports_nan_not_zero(tmp_path, capsys):
    net = make_net()
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(float("nan"))  # recorded output all NaN too: "no difference" would lie
    save(tmp_path / "root", net=net)
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded")
    assert code == 1, out
    assert "max |diff| nan" in out and "max |diff| 0 " not in out, out
    assert "NaN/Inf of 20 values" in out
    code, out, _ = cli(capsys, "verify", tmp_path / "root", "--level", "forward",
                       "--trust-recorded", "--json")
    forward = json.loads(out)["steps"][0]["forward"]
    assert code == 1 and forward["max_abs_diff"] == "nan", forward
