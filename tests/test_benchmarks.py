"""The benchmark code itself (tests/benchmarks/): `make bench-gpu` runs its reference loop and the real recipe on a
tiny base on the CPU, and the SD 1.5 architecture it measures on a GPU is SD 1.5's; `make bench`'s bucketed workloads:
their mixed-aspect images, their data-path timing, recipe-only workloads, and the table's rows (no bench runs here)."""
import json
import subprocess
import sys

from conftest import ROOT, offline_env

sys.path.insert(0, str(ROOT / "tests" / "benchmarks"))
CANVASES = [[48, 32], [32, 48], [40, 40]]  # (width, height): wide, tall, square, as workloads.toml


def write_source(folder, n):
    """An imagefolder split of n 32x32 RGB images, image i a grey square of value 10 * (i + 1) on white, and its
    metadata.jsonl (file_name, label, text)."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True)
    with open(folder / "metadata.jsonl", "w") as meta:
        for i in range(n):
            pixels = np.full((32, 32, 3), 255, np.uint8)
            pixels[4:28, 4:28] = 10 * (i + 1)
            Image.fromarray(pixels).save(folder / f"{i}.png")
            meta.write(json.dumps({"file_name": f"{i}.png", "label": i % 10, "text": f"digit {i}"}) + "\n")
    return folder


def test_sd15_architecture_has_stable_diffusion_1_5_parameter_counts():
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from demo.tiny_sd import SD15

    with torch.device("meta"):  # shapes only: nothing allocated
        models = {"unet": UNet2DConditionModel(**SD15["unet"]), "vae": AutoencoderKL(**SD15["vae"]),
                  "text": CLIPTextModel(CLIPTextConfig(**SD15["text"]))}
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    assert counts == {"unet": 859_520_964, "vae": 83_653_863, "text": 123_060_480}  # stable-diffusion-v1-5's


def test_sdxl_architecture_has_sdxl_parameter_counts():
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    from demo.tiny_sd import SDXL

    with torch.device("meta"):
        models = {"unet": UNet2DConditionModel(**SDXL["unet"]), "vae": AutoencoderKL(**SDXL["vae"]),
                  "text": CLIPTextModel(CLIPTextConfig(**SDXL["text"])),
                  "text_2": CLIPTextModelWithProjection(CLIPTextConfig(**SDXL["text_2"]))}
    counts = {name: sum(p.numel() for p in m.parameters()) for name, m in models.items()}
    # stable-diffusion-xl-base-1.0's: UNet 2.6 G, the SD VAE, CLIP ViT-L/14's and OpenCLIP ViT-bigG/14's text towers
    assert counts == {"unet": 2_567_463_684, "vae": 83_653_863, "text": 123_060_480, "text_2": 694_659_840}


def test_gpu_bench_reference_loop_runs_on_sdxl(tiny_sdxl, tmp_path):
    """`make bench-gpu-sdxl`'s reference loop (the pooled embedding and time ids too), as a CPU smoke run on the
    tiny SDXL; the recipe side is train_lora.py on SDXL, tested in test_lora_sdxl.py."""
    config = tmp_path / "workloads.toml"
    config.write_text(f"[gpu_sdxl]\nbase = {json.dumps(str(tiny_sdxl))}\narchitecture = \"sdxl\"\nresolution = 32\n"
                      "batch_sizes = [2]\nprecisions = [\"no\"]\nsteps = 6\nwarmup = 2\nargs = []\n"
                      "[gpu_sdxl.env]\nHF_HUB_OFFLINE = \"1\"\n")
    output = tmp_path / "gpu_sdxl_results.json"
    proc = subprocess.run(
        [sys.executable, "tests/benchmarks/gpu_lora.py", "--config", str(config), "--workload", "gpu_sdxl",
         "--device", "cpu", "--gradient_checkpointing", "off", "--no_recipe", "--output", str(output)],
        cwd=ROOT, env=offline_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (run,) = json.loads(output.read_text())["configs"]
    assert run["reference"]["steps_per_second"] > 0 and run["reference"]["flops_per_step"] > 1e6


def test_gpu_lora_bench_runs_the_reference_and_the_recipe(digits, tiny_sd, tmp_path):
    import tomllib

    with open(ROOT / "tests/benchmarks/workloads.toml", "rb") as f:
        gpu = tomllib.load(f)["gpu"]
    args = [str(digits) if a == "data/digits" else a for a in gpu["args"]]
    config = tmp_path / "workloads.toml"
    config.write_text(f"[gpu]\nbase = {json.dumps(str(tiny_sd))}\nresolution = 32\nbatch_sizes = [2]\n"
                      f"precisions = [\"no\"]\nsteps = 16\nwarmup = 3\nargs = {json.dumps(args)}\n"
                      "[gpu.env]\nHF_HUB_OFFLINE = \"1\"\n")
    output = tmp_path / "bench" / "gpu_results.json"
    env = offline_env()
    env.pop("TQDM_DISABLE")  # the recipe is timed by its progress bar
    proc = subprocess.run(
        [sys.executable, "tests/benchmarks/gpu_lora.py", "--config", str(config), "--device", "cpu",
         "--gradient_checkpointing", "off", "--launch_config", "accelerate_configs/cpu.yaml",
         "--launch_args", "--num_cpu_threads_per_process 1", "--output", str(output)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    results = json.loads(output.read_text())
    (run,) = results["configs"]
    assert (run["batch_size"], run["precision"], run["gradient_checkpointing"]) == (2, "no", False)
    for side in ("recipe", "reference"):
        assert run[side]["steps_per_second"] > 0 and run[side]["peak_memory_mb"] > 0
    assert run["reference"]["flops_per_step"] > 1e6  # counted: forward and backward of the UNet
    assert (tmp_path / "bench" / "gpu-no-b2" / "pytorch_lora_weights.safetensors").exists()  # the real recipe ran
    assert "| 2     | no" in proc.stdout and f"{run['reference']['steps_per_second']:.2f}" in results["table"]


def test_mixed_aspect_set_pastes_each_image_on_wide_tall_and_square_canvases_once(tmp_path):
    import numpy as np
    from mixed_aspect import write_mixed_aspect
    from PIL import Image

    source, out = write_source(tmp_path / "digits" / "train", 7), tmp_path / "mixed"
    assert write_mixed_aspect(str(source), str(out), CANVASES)
    rows = [json.loads(line) for line in (out / "train" / "metadata.jsonl").read_text().splitlines()]
    assert [(r["label"], r["text"]) for r in rows] == [(i % 10, f"digit {i}") for i in range(7)]  # captions kept
    for i, row in enumerate(rows):
        image = np.asarray(Image.open(out / "train" / row["file_name"]))
        width, height = CANVASES[i % 3]  # in turn: equal shares
        assert image.shape == (height, width, 3)
        top, left = (height - 32) // 2, (width - 32) // 2  # pasted in the middle, on black
        assert (image[top:top + 32, left:left + 32] == np.asarray(Image.open(source / f"{i}.png"))).all()
        image = image.copy()
        image[top:top + 32, left:left + 32] = 0
        assert not image.any()
    assert not (tmp_path / "mixed.tmp").exists()
    written = (out / "train" / rows[0]["file_name"]).stat().st_mtime_ns
    assert not write_mixed_aspect(str(source), str(out), CANVASES)  # already there: left alone
    assert (out / "train" / rows[0]["file_name"]).stat().st_mtime_ns == written
    assert write_mixed_aspect(str(source), str(out), [[40, 40]])  # other canvases: written again
    assert {Image.open(p).size for p in (out / "train").glob("*.png")} == {(40, 40)}


def test_bucketed_workloads_are_lora_uncached_on_the_mixed_aspect_set_without_reference_loops():
    import tomllib

    with open(ROOT / "tests/benchmarks/workloads.toml", "rb") as f:
        config = tomllib.load(f)
    uncached = config["workloads"]["lora_uncached"]
    data = config["mixed_aspect"]["output"]
    for name, flag in (("lora_buckets", ["--buckets", "auto"]), ("lora_square", ["--center_crop"])):
        w = config["workloads"][name]
        assert w["reference"] is False and "reference" not in uncached
        assert [w[key] for key in ("script", "batch_size", "steps", "warmup")] == \
            [uncached[key] for key in ("script", "batch_size", "steps", "warmup")]
        expected = [data if a == "data/digits" else a for a in uncached["args"]]
        assert sorted(w["args"]) == sorted(expected + flag)
    assert config["targets"]["min_bucket_ratio"] == 0.95
    assert config["mixed_aspect"]["canvases"] == CANVASES


def test_workloads_without_a_reference_loop_run_alone_and_stay_out_of_the_reference_summary():
    import run_bench

    config = {"workloads": {"a": {}, "b": {"reference": False}}}
    calls = []

    def fake(kind):
        def run(name, w, r):
            calls.append((r, name, kind))
            speed = {"a": 10.0, "b": 4.0}[name] * (2 if kind == "reference" else 1) + r
            return {"steps_per_second": speed, "steps_per_cpu_second": None, "samples_per_second": speed * 8,
                    "peak_rss_mb": 100.0, "first_step_s": 1.0, "load_average_1min": 0.5}
        return run

    runs = run_bench.run_workloads(config, ["a", "b"], 2, fake("recipe"), fake("reference"))
    assert calls == [(0, "a", "recipe"), (0, "a", "reference"), (0, "b", "recipe"),  # b: the recipe alone
                     (1, "b", "recipe"), (1, "a", "reference"), (1, "a", "recipe")]  # reversed every other repeat
    summary = run_bench.summarize(runs, {"min_ratio_to_reference": 0.95})
    assert list(summary) == ["a"] and summary["a"]["ratios"] == [0.5, 11 / 21]
    only = run_bench.recipe_only(runs)
    assert list(only) == ["b"] and only["b"]["recipe"]["steps_per_second"] == 4.5


def bench_results(bucket_speeds, square_speeds):
    """A results.json as run_bench.py writes it, for lora_buckets and lora_square alone (made-up numbers)."""
    import run_bench

    def runs(speeds):
        return [{"steps_per_second": v, "steps_per_cpu_second": v * 1.1, "samples_per_second": v * 32,
                 "peak_rss_mb": 700.0, "first_step_s": 6.5, "load_average_1min": 1.0} for v in speeds]

    runs = {"lora_buckets": {"recipe": runs(bucket_speeds), "reference": []},
            "lora_square": {"recipe": runs(square_speeds), "reference": []}}
    targets = {"min_ratio_to_reference": 0.95, "min_lora_cache_speedup": 1.5, "min_bucket_ratio": 0.95,
               "max_help_seconds": 1.0}
    path = {"off": (277.4, 334.9), "on": (443.9, 498.4)}
    return {"targets": targets, "workloads": run_bench.summarize(runs, targets),
            "recipe_only": run_bench.recipe_only(runs), "bucket_ratio": run_bench.bucket_ratio(runs, targets),
            "data_path": {name: {"batch_size": 32, "pixels_per_sample": pixels,
                                 **{f"random_flip_{flip}": {"median_us": us[i]} for flip, us in path.items()}}
                          for i, (name, pixels) in enumerate((("lora_buckets", 2944 / 3), ("lora_square", 1024.0)))}}


def test_table_has_the_bucket_ratio_and_the_data_path_rows():
    import run_bench

    results = bench_results([5.7, 5.5, 5.9], [6.0, 5.6, 5.8])
    ratio = results["bucket_ratio"]
    assert ratio["ratios"] == [5.7 / 6.0, 5.5 / 5.6, 5.9 / 5.8] and ratio["ratio"] == 5.5 / 5.6  # per-repeat median
    assert ratio["pass"] and ratio["steps_per_second"] == {"lora_buckets": 5.7, "lora_square": 5.8}
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in run_bench.table(results).splitlines()[2:]}
    assert rows["lora_buckets (981 px a sample)"][:2] == ["5.70 steps/s", "none"]  # no reference loop, no ratio
    assert rows["lora_square (1024 px a sample)"][:3] == ["5.80 steps/s", "none", ""]
    assert rows["lora buckets / square"] == ["5.70 / 5.80 steps/s", "per CPU second: 0.982", "0.982", ">= 0.95", "yes",
                                             "", "", ""]
    assert rows["data path, a batch of 32: buckets / square"][:3] == ["277 / 335 us", "", "0.83"]
    assert rows["data path, a batch of 32, --random_flip: buckets / square"][:3] == ["444 / 498 us", "", "0.89"]
    failed = bench_results([5.0, 5.1, 5.2], [6.0, 5.9, 6.1])
    assert not failed["bucket_ratio"]["pass"]
    assert "| **no** |" in run_bench.table(failed).split("lora buckets / square")[1].splitlines()[0]


def test_data_path_cost_times_bucket_and_square_batches_of_the_workload(tiny_sd, tmp_path):
    from mixed_aspect import data_path_cost, write_mixed_aspect

    source, data = write_source(tmp_path / "source" / "train", 9), tmp_path / "mixed"
    write_mixed_aspect(str(source), str(data), CANVASES)
    common = ["--pretrained_model_name_or_path", str(tiny_sd), "--train_data_dir", str(data), "--resolution", "32",
              "--train_batch_size", "2"]
    buckets = data_path_cost(common + ["--buckets", "auto"], batches=7)
    square = data_path_cost(common + ["--center_crop"], batches=7)
    assert buckets["pixels_per_sample"] == (40 * 24 * 2 + 32 * 32) / 3 and square["pixels_per_sample"] == 32 * 32
    for cost in (buckets, square):
        assert (cost["batch_size"], cost["images"]) == (2, 9)
        for flip in ("off", "on"):
            timed = cost[f"random_flip_{flip}"]
            assert timed["batches"] == 7 and 0 < timed["q1_us"] <= timed["median_us"] <= timed["q3_us"]
    assert "random_flip_off" not in data_path_cost(common + ["--buckets", "auto"], batches=0)  # the pixels only
