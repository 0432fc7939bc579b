import json
import math

import pytest

from hybrid_indexpool.scripts import bench_quality

pytestmark = pytest.mark.filterwarnings("ignore")

TINY = ["--context", "128", "--budget", "16", "--hidden-size", "32", "--layers", "2", "--batch-size", "2",
        "--train-steps", "4", "--warmup-steps", "3", "--sparse-steps", "2", "--eval-blocks", "2",
        "--passkey-samples", "4", "--recall-steps", "4"]


def test_tiny_run_writes_all_four_rows_after_each_stage_as_json_and_a_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (in the dev extra)")
    # Index-key storages are measured in a test of their own (below): '' skips them here.
    report = bench_quality.main(TINY + ["--json", str(tmp_path / "quality.json"), "--plot", str(tmp_path / "q.png"),
                                        "--key-cache-settings", ""])
    printed = capsys.readouterr().out
    assert "index keys" not in printed and report["key_cache_results"] == report["key_cache_results_after_sparse"] == []
    assert "machine:" in printed and "| learned pooling r=4 |" in printed and "context 128, budget 16" in printed
    written = json.loads((tmp_path / "quality.json").read_text())
    assert written["results"] == report["results"]
    rows = {row["setting"]: row for row in written["results"]}
    assert list(rows) == list(bench_quality.SETTINGS)
    assert (rows["learned_r4"]["pool_size"], rows["mean_r4"]["weighting"], rows["unpooled_r1"]["pool_size"]) == \
        (4, "mean", 1)
    assert (rows["learned_scalar_r4"]["weighting"], rows["prenorm_mean_r4"]["weighting"]) == \
        ("learned_scalar", "prenorm_mean")
    assert all(len(row["passkey_accuracy_by_depth"]) == bench_quality.DEPTH_BINS for row in rows.values())
    assert rows["dense"]["attention_mass"] == 1.0 and rows["dense"]["ppl_vs_dense"] == 0.0
    for setting in ("learned_r4", "mean_r4", "unpooled_r1"):
        row = rows[setting]
        assert 0.0 < row["attention_mass"] < 1.0 and row["ppl"] > 1.0 and 0.0 <= row["passkey_accuracy"] <= 1.0
        assert row["attention_mass"] <= row["best_selection_mass"] + 1e-6 < 1.0  # the bound of any indexer
        assert len(written["warmup_kl"][setting]) == 3 and row["warmup_kl_first"] > 0
    assert (tmp_path / "q.png").stat().st_size > 0
    # The recall curriculum ran (its 49-character stage; 128 is the full context here) and was measured.
    assert 0.0 <= written["base_training"]["passkey_accuracy_after_recall_curriculum"] <= 1.0
    assert "recall curriculum 4 x 4 x 49 tokens" in printed
    assert written["base_training"]["recall_curriculum"] == [{"context": 49, "steps": 4, "batch_size": 4}]
    # Each untrained indexer is measured before its warm-up, against the same dense base.
    assert "| learned pooling r=4 | untrained indexer |" in printed
    fresh = {row["setting"]: row for row in written["results_fresh"]}
    assert list(fresh) == [setting for setting in bench_quality.SETTINGS if setting != "dense"]
    assert all(math.isfinite(row["ppl_beyond_budget_vs_dense"]) for row in fresh.values())
    # After the sparse stage (dense: as many language-model steps) every setting is measured again.
    assert "| learned pooling r=4 | + stage 2 (2 steps) |" in printed
    after = {row["setting"]: row for row in written["results_after_sparse"]}
    assert list(after) == list(bench_quality.SETTINGS) and list(written["sparse_curves"]) == list(after)
    assert after["dense"]["ppl_vs_dense"] == 0.0 and "sparse_kl_first" not in after["dense"]
    for setting, row in after.items():
        for key in ("attention_mass", "ppl", "ppl_vs_dense", "ppl_beyond_budget", "ppl_beyond_budget_vs_dense",
                    "passkey_accuracy"):
            assert math.isfinite(row[key]), (setting, key)
        assert all(math.isfinite(lm_loss) for _, lm_loss, _ in written["sparse_curves"][setting])
        if setting != "dense":
            assert 0.0 < row["attention_mass"] < 1.0 and math.isfinite(row["sparse_kl_last"])


@pytest.mark.parametrize("extra, message", [
    (["--budget", "18"], "multiple of 4"),
    (["--context", "24"], "at least twice --budget"),
    (["--passkey-fraction", "1.5"], "between 0 and 1"),
    (["--recall-steps", "-1"], "must not be negative"),
    (["--sink-windows", "3", "--local-windows", "2"], "fit in the r=4 budget of 4 windows"),
    (["--settings", "mean_r4"], "must include dense"),
    (["--settings", "median_r4,dense"], "not ['median_r4']"),
    (["--max-needles", "0"], "between 1 and 26"),
    (["--max-needles", "27"], "between 1 and 26"),
    (["--max-needles", "5"], "more than half of --context 128"),
    (["--list-fraction", "-0.1"], "between 0 and 1"),
    (["--settings", "mean_r4,dense", "--key-cache-settings", "learned_r4"], "sparse settings of --settings"),
    (["--key-cache-settings", "dense"], "sparse settings of --settings"),
])
def test_bad_sizes_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        bench_quality.parse_arguments(TINY + extra)
    assert message in capsys.readouterr().err


def test_sink_and_local_windows_reach_the_sparse_settings_only():
    args = bench_quality.parse_arguments(TINY + ["--sink-windows", "1", "--local-windows", "2"])
    from hybrid_indexpool.tokenization import byte_level_tokenizer

    tokenizer = byte_level_tokenizer()
    sparse, dense = (bench_quality.model_config(setting, args, tokenizer) for setting in ("mean_r4", "dense"))
    assert (sparse.index_sink_windows, sparse.index_local_windows) == (1, 2)
    assert (dense.index_sink_windows, dense.index_local_windows) == (0, 0)


def test_a_subset_of_the_settings_can_be_chosen():
    args = bench_quality.parse_arguments(TINY + ["--settings", "prenorm_mean_r4,dense"])
    assert args.settings == ["prenorm_mean_r4", "dense"] and args.max_needles == 4  # what fits in 64 characters


def test_list_samples_hold_as_many_needles_as_fit_and_every_sample_the_context():
    text = "".join(f"value_{index} = compute({index}, other)\n" for index in range(3000))
    samples = bench_quality.training_samples(text, 40, 512, passkey_fraction=1.0, max_needles=3, list_fraction=0.5,
                                             seed=0)
    needles = [sample.count("$") // 2 for sample in samples]
    assert {len(sample) for sample in samples} == {512}
    assert set(needles) <= {1, 2, 3, 26} and 26 in needles and min(needles) <= 3  # 26: one per label letter


def test_each_sparse_setting_is_measured_with_full_precision_and_fp8_index_keys_side_by_side(capsys):
    report = bench_quality.main(TINY + ["--settings", "learned_r4,mean_r4,dense", "--key-cache-settings",
                                        "learned_r4,mean_r4"])
    printed = capsys.readouterr().out
    assert "| learned pooling r=4 | warm-up | fp8 e4m3, Hadamard-rotated (the cache's) |" in printed
    assert "| mean pooling r=4 | + stage 2 (2 steps) | fp8 e4m3 without rotation |" in printed
    for stage, main_rows in (("key_cache_results", report["results"]),
                             ("key_cache_results_after_sparse", report["results_after_sparse"])):
        rows = {(row["setting"], row["index_keys"]): row for row in report[stage]}
        assert list(rows) == [(setting, keys) for setting in ("learned_r4", "mean_r4")
                              for keys in bench_quality.KEY_CACHES]
        main = {row["setting"]: row for row in main_rows}
        for (setting, keys), row in rows.items():
            assert 0.0 <= row["identical_selections"] <= row["selection_overlap"] <= 1.0
            assert 0.0 < row["attention_mass"] < 1.0 and row["model_dtype"] == "float32"
            assert ("ppl" in row) == (bench_quality.KEY_CACHES[keys] is not None)  # only cache formats run a cache
            if keys != "auto":
                assert all(0.0 <= value <= 1.0 for value in row["selection_overlap_per_layer"])
        for setting in ("learned_r4", "mean_r4"):
            full, fp8 = rows[setting, "auto"], rows[setting, "float8_e4m3fn"]
            # Through a full-precision cache the model computes what it does without one: the main rows' numbers.
            assert full["ppl"] == pytest.approx(main[setting]["ppl"], rel=1e-5)
            assert full["attention_mass"] == pytest.approx(main[setting]["attention_mass"], abs=1e-6)
            assert full["passkey_accuracy"] == main[setting]["passkey_accuracy"]
            assert full["selection_overlap"] == 1.0 and full["ppl_beyond_budget_vs_full_precision"] == 0.0
            assert math.isfinite(fp8["ppl_beyond_budget_vs_full_precision"]) and 0.0 <= fp8["passkey_accuracy"] <= 1.0


def test_fp8_index_keys_need_a_power_of_two_index_head_dim(capsys):
    with pytest.raises(SystemExit):
        bench_quality.parse_arguments(TINY + ["--hidden-size", "96"])
    assert "power of two" in capsys.readouterr().err
    assert bench_quality.parse_arguments(TINY + ["--hidden-size", "96", "--key-cache-settings", ""]) \
        .key_cache_settings == []


def test_pool_sizes_8_and_16_at_the_same_budget_with_their_cache_bytes_and_the_distilled_gate(capsys):
    args = bench_quality.parse_arguments(TINY + ["--settings", "mean_r16,dense"])
    assert args.beyond_budget_from == 16 + 15  # where r = 16 starts pruning, for every setting of the run
    report = bench_quality.main(TINY + ["--settings", "mean_r8,distilled_scalar_r8,mean_r4,dense",
                                        "--key-cache-settings", "", "--no-untrained"])
    assert "| distilled scalar pooling r=8 | warm-up |" in capsys.readouterr().out
    assert report["results_fresh"] == []
    rows = {row["setting"]: row for row in report["results_after_sparse"]}
    assert (rows["mean_r8"]["pool_size"], rows["distilled_scalar_r8"]["weighting"]) == (8, "learned_scalar")
    # One IndexPool layer with float32 index keys of 16 channels: 64 bytes per pooled key, per token 64 / r.
    assert report["index_cache_bytes"]["mean_r8"] == {"tokens": 128, "pooled_index_keys": 8.0, "open_window": 0.0,
                                                      "per_token": 8.0, "unpooled": 64.0}
    assert rows["mean_r4"]["index_cache_bytes_per_token"] == 16.0 and "index_cache_bytes_per_token" not in rows["dense"]
    warmed = {row["setting"]: row for row in report["results"]}
    # Only the distilled setting trains its gate toward the attention its keys receive (both stages).
    assert warmed["distilled_scalar_r8"]["warmup_pool_distillation_first"] > 0
    assert rows["distilled_scalar_r8"]["sparse_pool_distillation_last"] > 0
    assert "warmup_pool_distillation_first" not in warmed["mean_r8"]
    for row in rows.values():
        if row["setting"] != "dense":
            assert 0.0 < row["attention_mass"] <= row["best_selection_mass"] + 1e-6 < 1.0


@pytest.mark.parametrize("extra, message", [
    (["--settings", "mean_r16,dense", "--budget", "24"], "multiple of 16 (the largest pool size"),
    (["--settings", "mean_r3,dense"], "not ['mean_r3']"),
    (["--settings", "mean_r8,dense", "--sink-windows", "2", "--local-windows", "1"],
     "fit in the r=8 budget of 2 windows"),
    (["--pool-distillation-weight", "-1"], "must not be negative"),
])
def test_bad_pool_sizes_are_refused(extra, message, capsys):
    with pytest.raises(SystemExit):
        bench_quality.parse_arguments(TINY + extra)
    assert message in capsys.readouterr().err


def test_a_rerun_resumes_from_the_results_folder_and_other_options_are_refused(tmp_path, capsys, monkeypatch):
    folder = str(tmp_path / "results")
    options = TINY + ["--key-cache-settings", "", "--no-untrained", "--results-dir", folder]
    first = bench_quality.main(options + ["--settings", "mean_r8,dense"])
    assert sorted(path.name for path in (tmp_path / "results").iterdir()) == \
        ["base.pt", "dense.json", "mean_r8.json", "options.json"]
    capsys.readouterr()
    ran = []
    run_setting = bench_quality.run_setting
    monkeypatch.setattr(bench_quality, "run_setting", lambda setting, *args: ran.append(setting) or
                        run_setting(setting, *args))
    second = bench_quality.main(options + ["--settings", "mean_r8,learned_r8,dense"])
    printed = capsys.readouterr().out
    # Neither the base model nor the finished settings are trained again; the new setting is.
    assert ran == ["learned_r8"] and "the dense base model from" in printed and "1/3 training" not in printed
    assert "mean_r8: finished in an earlier run" in printed
    assert second["results"][0] == first["results"][0] and second["results"][2] == first["results"][1]
    assert second["base_training"] == first["base_training"]
    with pytest.raises(SystemExit, match="holds results of other options \\(differing: train_steps\\)"):
        bench_quality.main(options[:options.index("--train-steps")] + ["--train-steps", "5"]
                           + options[options.index("--train-steps") + 2:] + ["--settings", "mean_r8,dense"])
    # Another schedule of the indexers in another folder starts from the same base model; another base is refused.
    base = str(tmp_path / "results" / "base.pt")
    other = [*TINY, "--key-cache-settings", "", "--no-untrained", "--settings", "mean_r8,dense"]
    other[other.index("--warmup-steps") + 1] = "2"
    third = bench_quality.main(other + ["--base-model", base, "--results-dir", str(tmp_path / "other")])
    assert "1/3 training" not in capsys.readouterr().out and third["base_training"] == first["base_training"]
    assert third["results"][0] != first["results"][0]  # fewer warm-up steps
    other[other.index("--train-steps") + 1] = "5"
    with pytest.raises(SystemExit, match="trained with other options \\(differing: train_steps\\)"):
        bench_quality.main(other + ["--base-model", base])


def test_the_study_summary_puts_each_pool_size_and_weighting_of_each_seed_side_by_side(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (in the dev extra)")
    paths = []
    for seed in (0, 1):
        paths.append(str(tmp_path / f"seed{seed}.json"))
        bench_quality.main(TINY + ["--settings", "mean_r8,learned_r8,mean_r4,dense", "--key-cache-settings", "",
                                   "--no-untrained", "--seed", str(seed), "--json", paths[-1]])
    capsys.readouterr()
    result = bench_quality.main(["--summarize", *paths, "--plot", str(tmp_path / "study.png")])
    table = result["table"]
    assert table == capsys.readouterr().out.strip()
    lines = table.split("\n\n")[0].splitlines()
    assert lines[0].startswith("| after | r | indexer cache bytes/token | weighting |")
    rows = {tuple(cell.strip() for cell in line.split("|")[1:5]): line for line in lines[2:]}
    assert set(rows) == {(stage, r, cache, weighting) for stage in ("warm-up", "+ stage 2")
                         for r, cache, weighting in (("8", "8", "mean"), ("8", "8", "learned"), ("4", "16", "mean"),
                                                     ("-", "-", "dense"))}
    # Two seeds per cell; mean pooling is its own reference.
    assert rows["+ stage 2", "8", "8", "mean"].split("|")[8].strip() == "+0.0 / +0.0"
    assert rows["warm-up", "8", "8", "learned"].count(" / ") == 6  # six measures, each of two seeds
    study = bench_quality.pool_size_study([json.loads((tmp_path / f"seed{seed}.json").read_text())
                                           for seed in (0, 1)])
    learned = next(entry for entry in study if entry["setting"] == "learned_r8" and entry["stage"] == "warm-up")
    assert learned["seeds"] == [0, 1] and learned["share_of_best"][1] == pytest.approx(
        learned["attention_mass"][1] / learned["best_selection_mass"][1])
    assert (tmp_path / "study.png").stat().st_size > 0
    # The base model's attention inside windows of each pool size of the run, per seed.
    concentration = json.loads((tmp_path / "seed0.json").read_text())["window_concentration"]
    assert set(concentration) == {"4", "8"}
    assert 0.0 < concentration["8"]["shared"] < concentration["8"]["per_query"] < math.log(8)
    assert "| 8 | 2.079 |" in table
