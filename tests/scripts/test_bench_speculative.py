"""The speculative decoding benchmark at toy sizes: verify cost (here and through another interpreter), generation
rows that match greedy decoding or say why a method did not run, and the command end to end."""

import json
import sys

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool.scripts import bench_speculative
from hybrid_indexpool.speculative_benchmark import copying_prompt, generation_row, verify_cost

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOY_WIDTHS = dict(layers=4, hidden_size=32, vocab_size=97, intermediate_size=32, num_attention_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  index_n_heads=2, index_head_dim=16, index_topk=8)


def test_verify_cost_times_every_width_against_one_token():
    measured = verify_cost(TOY_WIDTHS, "float32", context=12, widths=(1, 3), repeats=1)
    assert set(measured["seconds"]) == {1, 3} and all(value > 0 for value in measured["seconds"].values())
    assert measured["ratio"][1] == 1.0
    assert measured["ratio"][3] == pytest.approx(measured["seconds"][3] / measured["seconds"][1])


def test_the_baseline_runs_this_module_under_another_interpreter():
    measured = bench_speculative.baseline_verify_cost(sys.executable, dict(
        config_kwargs=TOY_WIDTHS, dtype="float32", context=8, widths=[1, 2], repeats=1))
    assert set(measured["seconds"]) == {1, 2} and measured["ratio"][1] == 1.0


def test_generation_rows_match_greedy_or_say_why_not():
    model = tiny_model(seed=1)
    prompt = copying_prompt(torch.arange(5, 25), torch.tensor([2, 3]))
    assert prompt.shape == (1, 2 * 22 + 3) and torch.equal(prompt[0, -3:], torch.tensor([2, 3, 5]))
    greedy = generation_row(model, prompt, 6, "greedy")
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:]
    assert greedy["tokens"] == expected.tolist() and greedy["generated"] == 6
    assert greedy["mean_accepted_per_verify"] == 1.0 and greedy["verify_forwards"] == 5
    assert greedy["cache_reserved_bytes"] > 0
    for method in ("prompt_lookup", "mtp"):
        row = generation_row(model, prompt, 6, method, 2, torch.tensor(greedy["tokens"]))
        # Until the model drafts this way generate() refuses, and the row says so; once it does, the tokens must be
        # greedy's.
        assert row.get("error") or row["same_tokens_as_greedy"], row


def test_command_reports_every_method_and_writes_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    report = bench_speculative.main(["--quick", "--skip-verify", "--contexts", "40", "--new-tokens", "3",
                                     "--copy-length", "24", "--draft-lengths", "1", "--json", str(path)])
    assert json.loads(path.read_text())["drafting"] == json.loads(json.dumps(report["drafting"]))
    tasks = {(row["task"], row["method"]) for row in report["drafting"]}
    assert tasks == {(task, method) for task in ("held-out text 40", "copying")
                     for method in ("greedy", "prompt_lookup", "mtp")}
    assert "greedy" in capsys.readouterr().out


def test_command_refuses_bad_widths(capsys):
    with pytest.raises(SystemExit):
        bench_speculative.parse_arguments(["--widths", "2,4"])
    assert "include 1" in capsys.readouterr().err
