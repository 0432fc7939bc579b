import pytest

from hybrid_indexpool.command_line import exit_with_error


def test_exit_with_error_prints_an_error_line_and_exits_with_status_2(capsys):
    with pytest.raises(SystemExit) as stop:
        exit_with_error("--topk is 0; give a positive number.")
    assert stop.value.code == 2
    assert capsys.readouterr().err == "error: --topk is 0; give a positive number.\n"
