import pytest

from hybrid_indexpool.scripts import demo

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_demo_generates_and_reports_a_quarter_size_indexer_cache(capsys):
    demo.main(["--prompt-length", "160", "--new-tokens", "4", "--topk", "32", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "generated 4 tokens after a 160-token prompt" in printed
    for component in ("key_value", "pooled_index_keys", "open_window", "conv_state", "recurrent_state", "total"):
        assert component in printed
    # 163 positions were cached: 40 pooled windows against 163 unpooled keys.
    assert "24.5% of the unpooled size" in printed
    assert "in use" in printed and "reserved" in printed


def test_demo_with_a_picture_runs_the_multimodal_model(capsys):
    demo.main(["--image", "--prompt-length", "120", "--new-tokens", "3", "--topk", "32", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "multimodal model (a 64 x 128 picture in the prompt)" in printed
    assert "generated 3 tokens after a 120-token prompt" in printed


def test_demo_refuses_a_prompt_within_the_budget():
    with pytest.raises(SystemExit):
        demo.main(["--prompt-length", "16", "--topk", "32"])


@pytest.mark.parametrize("flags, message", [
    (["--pool-size", "3"], "error: --topk (128) is not a multiple of --pool-size (3)"),
    (["--topk", "0"], "error: --topk is 0; give a positive number."),
    (["--new-tokens", "-1"], "error: --new-tokens is -1"),
    (["--device", "nowhere"], "error: --device 'nowhere' is not a device PyTorch knows"),
])
def test_bad_flags_end_with_an_error_naming_the_flag_and_status_2(capsys, flags, message):
    with pytest.raises(SystemExit) as stop:
        demo.main(["--prompt-length", "256", *flags])
    printed = capsys.readouterr().err
    assert stop.value.code == 2 and message in printed and "index_" not in printed


def test_the_cache_table_says_what_each_component_holds(capsys):
    demo.main(["--prompt-length", "72", "--new-tokens", "1", "--topk", "16", "--device", "cpu"])
    printed = capsys.readouterr().out
    for component, meaning in demo.CACHE_COMPONENTS.items():
        assert any(component in line and meaning in line for line in printed.splitlines())
