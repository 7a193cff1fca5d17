"""`python -m lohan.capacity`: the paper's headline capacity statement, from the command line."""

from __future__ import annotations

import pytest

from lohan.capacity import main, report


def test_175b_on_a_4090_with_256gb(capsys):
    assert main(["--model", "175b", "--hardware", "rtx4090,12xP5510,256GB", "--seq", "1024"]) == 0
    out = capsys.readouterr().out
    ours, _, zero = out.partition("activations in main memory (ZeRO-Infinity style)")
    assert "=> fits" in ours and "largest batch for 175b at seq 1024:" in ours
    assert "=> does NOT fit" in zero and "main memory: needs" in zero


def test_too_small_machine_says_why():
    text = report("412b", "rtx4080,1xP5510,16GB", seq=1024, compare=False)
    assert "does NOT fit" in text
    assert "does not fit at any batch size" in text


def test_bad_hardware_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--hardware", "gtx9999,1xP5510,64GB"])
    assert e.value.code == 2
    assert "gtx9999" in capsys.readouterr().err
