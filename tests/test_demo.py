"""The README's quickstart demo runs and reports success."""
from sp_attention.demo import main


def test_demo_two_ranks(capsys):
    assert main(["--world-size", "2"]) == 0
    assert "OK" in capsys.readouterr().out
