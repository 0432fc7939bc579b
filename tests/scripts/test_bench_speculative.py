"""The speculative decoding benchmark at toy sizes: verify cost, generation rows that match greedy decoding and
measure what drafting holds (rollback recording, the drafter's cache, drafting rounds), the derived speedup's formula,
and the command's argument checks. The command end to end, the baseline interpreter and the training of the drafting
model are marked slow (each starts processes or reads the standard library's text)."""

import itertools
import json
import sys

import pytest
import torch
from model_factory import tiny_model

from hybrid_indexpool.scripts import bench_speculative
from hybrid_indexpool.speculative_benchmark import (
    compare_methods,
    copying_prompt,
    draft_cost,
    generation_row,
    verify_cost,
)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def one_thread():
    """Toy models gain nothing from a second thread, and on a loaded machine torch's threads wait for each other at
    every operator (a test here took 20x longer with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

TOY_WIDTHS = dict(layers=4, hidden_size=32, vocab_size=97, intermediate_size=32, num_attention_heads=2, head_dim=16,
                  linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                  index_n_heads=2, index_head_dim=16, index_topk=8)


def test_verify_cost_times_every_width_against_one_token():
    measured = verify_cost(TOY_WIDTHS, "float32", context=12, widths=(1, 3), repeats=1)
    assert set(measured["seconds"]) == {1, 3} and all(value > 0 for value in measured["seconds"].values())
    assert measured["ratio"][1] == 1.0
    assert measured["ratio"][3] == pytest.approx(measured["seconds"][3] / measured["seconds"][1])


def test_generation_rows_match_greedy_and_count_what_drafting_holds():
    model = tiny_model(seed=1, num_mtp_layers=1)
    prompt = copying_prompt(torch.arange(5, 25), torch.tensor([2, 3]))
    assert prompt.shape == (1, 2 * 22 + 3) and torch.equal(prompt[0, -3:], torch.tensor([2, 3, 5]))
    greedy = generation_row(model, prompt, 6, "greedy")
    expected = model.generate(prompt, max_new_tokens=6, do_sample=False)[0, prompt.shape[1]:]
    assert greedy["tokens"] == expected.tolist() and greedy["generated"] == 6
    assert greedy["mean_accepted_per_verify"] == 1.0 and greedy["verify_forwards"] == 5
    assert greedy["cache_reserved_bytes"] > 0 and not greedy["rollback_bytes"]
    assert "draft_round_seconds" not in greedy
    lookup = generation_row(model, prompt, 6, "prompt_lookup", 3, torch.tensor(greedy["tokens"]))
    assert lookup["same_tokens_as_greedy"] and lookup["rollback_bytes"] > 0, lookup
    assert lookup["mean_verify_width"] > 1  # the copy in the prompt gave it something to draft
    mtp = generation_row(model, prompt, 6, "mtp", 2, torch.tensor(greedy["tokens"]))
    assert mtp["same_tokens_as_greedy"], mtp
    assert mtp["draft_round_seconds"] > 0 and mtp["draft_cache_bytes"] > 0 and mtp["rollback_bytes"] > 0
    assert 0 <= mtp["accepted_drafts_per_verify"] <= 2


def test_generation_rows_read_the_clock_they_are_given():
    """`clock` (e.g. `time.thread_time` for CPU seconds) times the rows: a clock that ticks once per reading gives a
    drafting round of exactly one tick (read before and after it) and whole ticks after the prefill."""
    model = tiny_model(seed=1, num_mtp_layers=1)
    ticks = itertools.count()
    row = generation_row(model, torch.arange(5, 25)[None], 4, "mtp", 1, clock=lambda: float(next(ticks)))
    assert row["draft_round_seconds"] == 1.0
    assert row["decode_seconds"] >= 2 and row["decode_seconds"] == int(row["decode_seconds"])
    assert row["tokens_per_second"] == 4 / row["decode_seconds"]


def test_a_method_generate_refuses_is_reported_not_raised():
    model = tiny_model(seed=1)  # no MTP layers: generate(use_mtp=True) refuses
    row = generation_row(model, torch.arange(5, 20)[None], 3, "mtp", 1)
    assert row["error"].startswith("ValueError") and "tokens_per_second" not in row


def test_compared_methods_take_turns_and_add_extra_bytes():
    model = tiny_model(seed=2, num_mtp_layers=1)
    rows = compare_methods(model, torch.arange(5, 30)[None], 4, draft_lengths=(1,), prompt_lookup_tokens=2, repeats=2)
    assert [(row["method"], row["draft_tokens"]) for row in rows] == [("greedy", 0), ("prompt_lookup", 2), ("mtp", 1)]
    for row in rows:
        assert len(row["tokens_per_second_runs"]) == 2
        assert min(row["tokens_per_second_runs"]) <= row["tokens_per_second"] <= max(row["tokens_per_second_runs"])
        assert row["speedup"] == pytest.approx(row["tokens_per_second"] / rows[0]["tokens_per_second"])
    assert rows[0]["extra_cache_bytes"] == 0
    mtp = rows[2]
    assert mtp["extra_cache_bytes"] == (mtp["cache_reserved_bytes"] - rows[0]["cache_reserved_bytes"]
                                        + mtp["rollback_bytes"] + mtp["draft_cache_bytes"])


def test_draft_cost_continues_one_prefilled_cache_per_method():
    rows = draft_cost(TOY_WIDTHS, "float32", context=20, draft_lengths=(2,), new_tokens=4, repeats=1)
    greedy, mtp = rows
    assert (greedy["method"], mtp["method"], mtp["draft_tokens"]) == ("greedy", "mtp", 2)
    assert mtp["same_tokens_as_greedy"] and mtp["draft_round_seconds"] > 0
    assert greedy["generated"] == mtp["generated"] == 4


def test_derived_speedup_follows_from_acceptance_and_measured_times():
    report = {
        "verify": [{"code": "this checkout", "dtype": "bfloat16", "seconds": {1: 0.1, 2: 0.12, 3: 0.13}},
                   {"code": "baseline", "dtype": "bfloat16", "seconds": {1: 1.0, 2: 9.0, 3: 9.0}}],
        "weight_bound_drafting": [{"dtype": "bfloat16", "method": "mtp", "draft_tokens": k,
                                   "draft_round_seconds": 0.01 * k} for k in (1, 2)],
        "drafting": [{"task": f"held-out text {context}", "dtype": "float32", "method": "mtp", "draft_tokens": k,
                      "context": context, "accepted_drafts_per_verify": accepted}
                     for context, k, accepted in ((100, 1, 0.9), (400, 1, 0.5), (400, 2, 0.8))],
    }
    derived = bench_speculative.derived_speedups(report)
    assert [(row["dtype"], row["draft_tokens"]) for row in derived] == [("bfloat16", 1), ("bfloat16", 2)]
    # The longest context's acceptance; the measured times of this checkout, not the baseline's.
    assert derived[0]["tokens_per_verify"] == pytest.approx(1.5)
    assert derived[0]["derived_speedup"] == pytest.approx(1.5 * 0.1 / (0.12 + 0.01))
    assert derived[1]["derived_speedup"] == pytest.approx(1.8 * 0.1 / (0.13 + 0.02))
    assert "held-out text 400 (float32)" == derived[0]["acceptance_from"]


def test_the_copying_summary_takes_the_median_and_range_over_passages():
    def row(passage, method, k, speedup, per_verify, **extra):
        counts = ({"accepted_drafts_per_verify": per_verify - 1} if method == "mtp"
                  else {"mean_accepted_per_verify": per_verify})
        return {"task": "copying", "dtype": "float32", "passage": passage, "method": method, "draft_tokens": k,
                "speedup": speedup, "tokens_per_second": 10 * speedup, "same_tokens_as_greedy": True, **counts,
                **extra}

    rows = [row(0, "prompt_lookup", 5, 2.8, 5.3), row(1, "prompt_lookup", 5, 1.4, 2.7),
            row(2, "prompt_lookup", 5, 2.0, 4.0, same_tokens_as_greedy=False), row(0, "mtp", 3, 1.5, 3.9),
            row(1, "mtp", 3, 1.3, 3.5), {"task": "held-out text 64", "dtype": "float32", "method": "mtp",
                                         "draft_tokens": 3, "speedup": 9.0, "accepted_drafts_per_verify": 2.0},
            {"task": "copying", "dtype": "float32", "passage": 2, "method": "mtp", "draft_tokens": 3,
             "error": "ValueError: refused"}]
    summary = {(entry["method"], entry["draft_tokens"]): entry for entry in bench_speculative.copying_summary(rows)}
    lookup, mtp = summary[("prompt_lookup", 5)], summary[("mtp", 3)]
    assert lookup["passages"] == 3 and lookup["speedup_median"] == 2.0 and lookup["speedup_range"] == [1.4, 2.8]
    assert lookup["tokens_per_verify_median"] == 4.0 and lookup["tokens_per_verify_range"] == [2.7, 5.3]
    assert not lookup["same_tokens_as_greedy"]
    # The held-out row and the refused run stay out; MTP's count is the drafter's own, plus one.
    assert mtp["passages"] == 2 and mtp["speedup_median"] == pytest.approx(1.4)
    assert mtp["tokens_per_verify_range"] == pytest.approx([3.5, 3.9]) and mtp["same_tokens_as_greedy"]


@pytest.mark.parametrize("arguments, message", [
    (["--widths", "2,4"], "include 1"),
    (["--copy-passages", "0"], "--copy-passages is 0; give at least 1 passage"),
    (["--layers", "6"], "multiple of 4"),
    (["--drafting-dtypes", "float16"], "use float32 and/or bfloat16"),
    (["--model", "a", "--train", "b"], "not both"),
])
def test_command_refuses_bad_arguments(arguments, message, capsys):
    with pytest.raises(SystemExit):
        bench_speculative.parse_arguments(arguments)
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_the_baseline_runs_this_module_under_another_interpreter():
    measured = bench_speculative.baseline_verify_cost(sys.executable, dict(
        config_kwargs=TOY_WIDTHS, dtype="float32", context=8, widths=[1, 2], repeats=1))
    assert set(measured["seconds"]) == {1, 2} and measured["ratio"][1] == 1.0


@pytest.mark.slow
def test_command_reports_every_method_and_writes_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    report = bench_speculative.main(["--quick", "--skip-verify", "--contexts", "40", "--new-tokens", "3",
                                     "--copy-length", "24", "--copy-passages", "2", "--draft-lengths", "1",
                                     "--drafting-dtypes", "float32", "--json", str(path)])
    assert json.loads(path.read_text())["drafting"] == json.loads(json.dumps(report["drafting"]))
    tasks = {(row["task"], row["method"]) for row in report["drafting"]}
    assert tasks == {(task, method) for task in ("held-out text 40", "copying")
                     for method in ("greedy", "prompt_lookup", "mtp")}
    assert all(row["same_tokens_as_greedy"] for row in report["drafting"] if row["method"] != "greedy")
    assert sorted({row["passage"] for row in report["drafting"] if row["task"] == "copying"}) == [0, 1]
    assert {(row["method"], row["passages"]) for row in report["copying_summary"]} == {
        ("greedy", 2), ("prompt_lookup", 2), ("mtp", 2)}
    printed = capsys.readouterr().out
    assert "greedy" in printed and "Copying task over 2 passages" in printed


@pytest.mark.slow
def test_training_the_drafting_model_gives_a_checkpoint_with_an_mtp_head(tmp_path):
    from hybrid_indexpool import HybridIndexPoolForCausalLM
    from hybrid_indexpool.speculative_benchmark import train_drafting_model

    folder = train_drafting_model(str(tmp_path), base_steps=2, mtp_steps=2, hidden_size=32, layers=2,
                                  block_size=32, batch_size=2)
    model = HybridIndexPoolForCausalLM.from_pretrained(folder)
    assert model.config.num_mtp_layers == 1
    log = json.loads((tmp_path / "training.json").read_text())
    assert log["settings"]["base_steps"] == 2 and any("mtp_loss" in entry for entry in log["mtp"]["log_history"])
    # The head trained alone: the base model's weights are those the first stage saved.
    base = HybridIndexPoolForCausalLM.from_pretrained(str(tmp_path / "base"))
    assert torch.equal(base.lm_head.weight, model.lm_head.weight)
