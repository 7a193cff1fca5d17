"""`python -m lohan.capacity`: the paper's headline capacity statement, from the command line."""

from __future__ import annotations

import pytest

from lohan.capacity import main, report


def test_175b_with_256gb(capsys):
    """The paper's headline machine, but for the GPU: 256 GB of RAM hold 175B with LoHan and not with
    activations in main memory. A 4090 (24 GiB) holds the engine's working set of a 175B block (planner.gpu_need)
    only at prefetch depth 1 and batch 1, so the fit is shown on an H100 and the 4090's refusal at the default
    depth names the GPU."""
    assert main(["--model", "175b", "--hardware", "h100,12xP5510,256GB", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    ours, _, zero = out.partition("activations in main memory (ZeRO-Infinity style)")
    assert "=> fits" in ours and "largest batch for 175b at seq 1024:" in ours
    assert "=> does NOT fit" in zero and "main memory: needs" in zero
    assert main(["--model", "175b", "--hardware", "rtx4090,12xP5510,256GB", "--no-compare"]) == 0
    out = capsys.readouterr().out
    assert "=> does NOT fit" in out and "GPU memory: needs" in out and "block gradients" in out


def test_too_small_machine_says_why():
    text = report("412b", "rtx4080,1xP5510,16GB", seq=1024, compare=False)
    assert "does NOT fit" in text
    assert "does not fit at any batch size" in text


def test_bad_hardware_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--hardware", "gtx9999,1xP5510,64GB"])
    assert e.value.code == 2
    assert "gtx9999" in capsys.readouterr().err
