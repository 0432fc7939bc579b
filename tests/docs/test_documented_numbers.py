"""The numbers the README and docs/testing.md state are those of what they cite: the count of tests the default
selection collects (`pytest --collect-only -q`), and the README's headline measurements, read from the result files
of the benchmarks they link to. A number that changes fails here with the value to write."""

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
RESULTS = ROOT / "docs" / "results"
COMMON = "tests/transformers_common/"
# How both pages state the count: the whole default selection, and the part that is transformers' common tests
# (collected only once `tests/transformers_common/prepare.py` has fetched them).
TEST_COUNT = re.compile(r"collects ([\d,]+) tests \(([\d,]+) of them transformers' common tests\)")


def number(text: str) -> int:
    return int(text.replace(",", ""))


def sentence(pattern: str, text: str = README) -> re.Match:
    found = re.search(pattern, " ".join(text.split()))
    assert found, f"no sentence matching {pattern!r}"
    return found


def default_selection(collected_in_this_run) -> list[str]:
    """The node ids of the default selection: this run's, when it collected the whole default selection, else a
    collection of its own in a fresh process (as `python -m pytest --collect-only -q` from the checkout's root)."""
    if collected_in_this_run is not None:
        return collected_in_this_run
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:randomly"], cwd=ROOT,
                            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


def test_the_documented_test_count_is_what_the_default_selection_collects(collected_in_this_run):
    node_ids = default_selection(collected_in_this_run)
    common = [node for node in node_ids if node.startswith(COMMON)]
    prepared = (ROOT / ".transformers_tests").is_dir()
    for page in ("README.md", "docs/testing.md"):
        found = sentence(TEST_COUNT.pattern, (ROOT / page).read_text())
        total, documented_common = number(found.group(1)), number(found.group(2))
        # Without the prepared common tests only the others are collected: they must still add up.
        others = len(node_ids) - len(common)
        expected_common = len(common) if prepared else documented_common
        assert (others, expected_common) == (total - documented_common, documented_common), (
            f"{page} says {found.group(0)!r}; write 'collects {others + expected_common:,} tests ({expected_common} "
            "of them transformers' common tests)'")


def rounded_range(values, digits: int) -> str:
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    return low if low == high else f"{low}-{high}"


def test_the_readme_decode_numbers_are_those_of_the_runs_it_cites():
    repeats = json.loads((RESULTS / "bench_decode_flash_next_1m_repeats.json").read_text())["runs"]
    # The runs of the commit the decode benchmark's page and the long-context guide quote (the selection in C).
    runs = [run for run in repeats if run["commit"] == repeats[0]["commit"]]
    indexer, whole, roofline = [], [], []
    for run in runs:
        rows = {row["setting"]: row for row in run["results"]}
        pooled, unpooled = rows["pooled_r4"], rows["unpooled_r1"]
        indexer.append(unpooled["indexer_ms"] / pooled["indexer_ms"])
        whole.append(unpooled["decode_ms"] / pooled["decode_ms"])
        best = min(pooled["decode_ms"], pooled["compiled_decode_ms"])
        roofline.append(best / (1e3 * pooled["roofline_bytes"] / pooled["copy_bandwidth"]))
    found = sentence(r"the pooled indexer step is ([\d.]+)x-([\d.]+)x faster than the per-token one \(median "
                     r"([\d.]+)x\) and the whole decode step ([\d.]+)x-([\d.]+)x faster, within ([\d.]+)x-([\d.]+)x "
                     r"of its copy-bandwidth roofline")
    assert found.groups() == (f"{min(indexer):.1f}", f"{max(indexer):.1f}", f"{statistics.median(indexer):.1f}",
                              f"{min(whole):.1f}", f"{max(whole):.1f}", f"{min(roofline):.2f}", f"{max(roofline):.2f}")

    rows = {row["setting"]: row for row in json.loads((RESULTS / "bench_decode_1m.json").read_text())["results"]
            if row["context"] == 1 << 20}
    pooled, dense = rows["pooled_r4"]["decode_ms"], rows["dense"]["decode_ms"]
    found = sentence(r"decodes at 1M tokens in ([\d.]+) ms per token against ([\d.]+) ms for dense attention "
                     r"\(([\d.]+)x\)")
    assert found.groups() == (f"{pooled:.1f}", f"{dense:.0f}", f"{dense / pooled:.1f}")


def test_the_readme_quality_range_is_that_of_both_runs_of_the_quality_benchmark():
    short = json.loads((RESULTS / "bench_quality.json").read_text())
    long = json.loads((RESULTS / "bench_quality_1500.json").read_text())
    pooled = ("learned_r4", "mean_r4")

    def gaps(rows):  # the pooled indexers' perplexity over dense, in percent
        return [100 * row["ppl_vs_dense"] for row in rows if row["setting"] in pooled]

    found = sentence(r"the pooled indexers' perplexity is \+([\d.-]+)% over dense attention on the small quality "
                     r"benchmark's 600-step model and \+([\d.-]+)% on its 1500-step model .*? 100 steps of the sparse "
                     r"stage bring the 600-step model's to \+([\d.-]+)%")
    assert short["settings"]["train_steps"] == 600 and long["settings"]["train_steps"] == 1500
    assert found.groups() == (rounded_range(gaps(short["results"]), 1), rounded_range(gaps(long["results"]), 1),
                              rounded_range(gaps(short["results_after_sparse"]), 1))


def test_the_readme_copying_range_is_that_of_the_speculative_benchmarks_passages():
    report = json.loads((RESULTS / "bench_speculative_copying.json").read_text())
    lookup = next(row for row in report["copying_summary"] if row["method"] == "prompt_lookup")
    found = sentence(r"prompt lookup ([\d.]+)x-([\d.]+)x greedy on a copying task over (\w+) passages, median "
                     r"([\d.]+)x")
    words = {"five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
    low, high = lookup["speedup_range"]
    assert found.groups() == (f"{low:.2f}", f"{high:.2f}", found.group(3), f"{lookup['speedup_median']:.2f}")
    assert words.get(found.group(3), found.group(3)) == lookup["passages"] == report["settings"]["copy_passages"]
