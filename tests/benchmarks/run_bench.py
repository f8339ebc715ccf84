"""`make bench`: steps/s, samples/s, peak RSS and time to first step of each recipe against its reference loop,
train_lora.py's --cache_latents speed-up, its aspect-ratio buckets against square crops (steps/s, and one batch
through the data path), sample.py images/s and `--help` latency; one table, and the same data in
outputs/bench/results.json.

    .venv/bin/python tests/benchmarks/run_bench.py [--repeats 1] [--only classifier,ddpm]

Each measurement is a fresh process; the recipe is launched as users launch it (`accelerate launch`, the settings
of workloads.toml). Steady-state steps/s comes from the recipe's own progress bar: the runner timestamps each
tqdm update as it arrives, so one run gives the rate between step `warmup` and the last step, without start-up,
evaluation or saving. Recipe and reference runs alternate; the medians over the repeats are reported. A workload
with `reference = false` (lora_buckets, lora_square: compared with each other) runs the recipe alone.
"""
import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import re
import select
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import tomllib

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "outputs", "bench")
sys.path.insert(0, HERE)

import mixed_aspect  # noqa: E402  (tests/benchmarks/mixed_aspect.py: the data of lora_buckets and lora_square)

# tqdm's "steps:  43%|####  | 10/23" (diffusers' examples: "Steps:")
PROGRESS = re.compile(rb"(?i)steps:\s+\d+%\|[^|\r\n]*\|\s*(\d+)/(\d+)")
BUCKETS, SQUARE = "lora_buckets", "lora_square"  # --buckets auto against square center crops of the same images


def bench_env(config):
    env = dict(os.environ, **config["env"])
    env.pop("TQDM_DISABLE", None)  # the progress bar is what we time
    return env


def tree_cpu_seconds(pid):
    """CPU time (user + system) of a process and its descendants, from Linux's /proc; None elsewhere. Kept beside
    the wall time in results.json: when they agree, the process had a core to itself, so a slow run was slowed by
    the host (shared caches, neighbours), not by other jobs of this machine."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, IndexError):
            if p == pid:
                return None
    return total / os.sysconf("SC_CLK_TCK")


def kill_tree(pid):
    """SIGKILL a process and every process below it (Linux's /proc), youngest first: a launcher's workers too."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    for p in reversed(tree):
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


def stream_timed(cmd, env, log_path, timeout=None):
    """Run cmd, stdout+stderr to log_path; past `timeout` seconds kill it and everything it started.
    -> (return code, or None when killed; wall seconds; {step n: (wall, CPU seconds) when tqdm showed it})."""
    seen, killed = {}, False
    with open(log_path, "wb", buffering=0) as log:  # unbuffered: a killed run still leaves its log
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        fd = proc.stdout.fileno()
        while True:
            if timeout is not None:
                left = timeout - (time.perf_counter() - start)
                if left <= 0 and not killed:
                    kill_tree(proc.pid)
                    killed = True
                if not select.select([fd], [], [], 1.0 if killed else min(left, 1.0))[0]:
                    if killed and proc.poll() is not None:
                        break  # its children are gone too, or hold the pipe open in vain
                    continue
            chunk = os.read(fd, 1 << 16)  # tqdm flushes each update: one small write
            if not chunk:
                break
            now = time.perf_counter() - start
            log.write(chunk)
            steps = [int(match[1]) for match in PROGRESS.finditer(chunk) if int(match[1]) not in seen]
            if steps:
                cpu = tree_cpu_seconds(proc.pid)
                seen.update((n, (now, cpu)) for n in steps)
        rc = proc.wait()
        wall = time.perf_counter() - start
    return None if killed else rc, wall, seen


def run_timed(cmd, env, log_path):
    """Run cmd, stdout+stderr to log_path. -> (wall seconds, {step n: (wall, CPU seconds) when tqdm showed it})."""
    rc, wall, seen = stream_timed(cmd, env, log_path)
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {rc}; see {log_path}")
    return wall, seen


def steady_rate(seen, warmup, steps, eval_every=None):
    """Steps/s from the progress updates `seen` (stream_timed's), between step `warmup` and the last update before
    step `steps` (tqdm prints the final step again when the bar closes, after evaluation and saving), less the
    intervals that hold a multiple of `eval_every` (an end-of-epoch evaluation, a checkpoint). -> {steps_per_second,
    steps_per_cpu_second (None where /proc is missing), timed_steps, first_step_s: launch to the end of step 1},
    or None when fewer than two updates fall in that range."""
    points = sorted((n, t) for n, t in seen.items() if warmup <= n < steps)
    every = eval_every or steps
    kept = [(n1 - n0, t1[0] - t0[0], t1[1] - t0[1] if t0[1] is not None and t1[1] is not None else None)
            for (n0, t0), (n1, t1) in zip(points, points[1:])
            if not any(n0 <= k < n1 for k in range(every, steps, every))]
    if not kept:
        return None
    timed_steps = sum(k[0] for k in kept)
    rate = timed_steps / sum(k[1] for k in kept)
    cpu_rate = timed_steps / sum(k[2] for k in kept) if None not in [k[2] for k in kept] else None
    first = min(n for n in seen if n >= 1)
    return {"steps_per_second": rate, "steps_per_cpu_second": cpu_rate, "timed_steps": timed_steps,
            "first_step_s": seen[first][0] - (first - 1) / rate}


def accelerate_cli():
    """The `accelerate` command of this Python (the venv's, as users type it)."""
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    return [accelerate] if os.path.exists(accelerate) else [sys.executable, "-m", "accelerate.commands.accelerate_cli"]


def recipe_run(name, w, config, launcher, env, tag, root=OUT):
    out = os.path.join(root, name)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [*launcher, *config["launch"], w["script"], *w["args"], "--max_train_steps", str(w["steps"]),
           "--output_dir", out]
    wall, seen = run_timed(cmd, env, os.path.join(root, "logs", f"{name}-recipe-{tag}.log"))
    timed = steady_rate(seen, w["warmup"], w["steps"], w.get("eval_every"))
    if timed is None:
        raise SystemExit(f"{name}: too few progress updates to time ({sorted(seen)}); see the log in {root}/logs")
    rate = timed["steps_per_second"]
    with open(os.path.join(out, "all_results.json")) as f:
        results = json.load(f)
    return {"steps_per_second": rate, "steps_per_cpu_second": timed["steps_per_cpu_second"],
            "samples_per_second": rate * w["batch_size"], "peak_rss_mb": results["peak_memory_mb"],
            "first_step_s": timed["first_step_s"], "wall_s": wall, "timed_steps": timed["timed_steps"],
            "load_average_1min": os.getloadavg()[0]}


def reference_run(name, w, env, tag):
    cmd = [sys.executable, os.path.join(HERE, "reference_loops.py"), name, "--steps", str(w["steps"]),
           "--warmup", str(w["warmup"])]
    launched = time.time()
    with open(os.path.join(OUT, "logs", f"{name}-reference-{tag}.log"), "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}; see {OUT}/logs")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"steps_per_second": result["steps_per_second"], "steps_per_cpu_second": result["steps_per_cpu_second"],
            "samples_per_second": result["steps_per_second"] * w["batch_size"],
            "peak_rss_mb": round(result["peak_rss_mb"], 1), "first_step_s": result["first_step_at"] - launched,
            "wall_s": time.time() - launched, "load_average_1min": os.getloadavg()[0]}


# sample.py as users run it, plus a timer around its sampling loop (common.diffusion.sample_images), so that
# images/s is given both end to end and without the start-up (imports, loading) that dominates a 16-image run.
TIMED_SAMPLE = """
import runpy, sys, time
import common.diffusion as sampling
inner = sampling.sample_images
def timed(*args, **kwargs):
    start = time.perf_counter()
    images = inner(*args, **kwargs)
    print(f"BENCH sampling_s={time.perf_counter() - start}", file=sys.stderr, flush=True)
    return images
sampling.sample_images = timed
sys.argv = sys.argv[1:]
runpy.run_path("sample.py", run_name="__main__")
"""


def sample_run(config, env, tag):
    s = config["sample"]
    cmd = [sys.executable, "-c", TIMED_SAMPLE, "sample.py", "--model", os.path.join(OUT, "ddpm"),
           "--class_label", s["class_label"], "--num_inference_steps", str(s["steps"]),
           "--num_images", str(s["num_images"]), "--output_dir", os.path.join(OUT, "samples")]
    log_path = os.path.join(OUT, "logs", f"sample-{tag}.log")
    wall, _ = run_timed(cmd, env, log_path)
    with open(log_path) as f:
        sampling = float(re.search(r"BENCH sampling_s=([0-9.e-]+)", f.read())[1])
    return {"images_per_second": s["num_images"] / wall, "sampling_images_per_second": s["num_images"] / sampling,
            "wall_s": wall, "sampling_s": sampling}


def help_latency(config, env):
    times = {}
    for script in config["help"]["scripts"]:
        runs = []
        for _ in range(config["help"]["runs"]):
            start = time.perf_counter()
            subprocess.run([sys.executable, script, "--help"], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                           check=True)
            runs.append(time.perf_counter() - start)
        times[script] = {"median_s": statistics.median(runs), "runs_s": runs}
    return times


def machine_facts():
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    versions = {pkg: importlib.metadata.version(pkg) for pkg in ("torch", "accelerate", "diffusers", "transformers")}
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            **versions, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "load_average_at_start": os.getloadavg()}


def median_of(runs, key):
    values = [run[key] for run in runs]
    return None if None in values else statistics.median(values)


def has_reference(workload):
    return workload.get("reference", True)


def run_workloads(config, names, repeats, recipe, reference, after_repeat=None):
    """Each workload `repeats` times: recipe(name, workload, r) and, where the workload has a reference loop,
    reference(name, workload, r) back to back, the side that goes first alternating; the workloads in reverse order
    every other repeat (lora_buckets and lora_square are compared with each other). after_repeat(r) after each
    repeat. -> {name: {"recipe": [runs], "reference": [runs, or none]}}."""
    runs = {name: {"recipe": [], "reference": []} for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            w = config["workloads"][name]
            order = ["recipe", "reference"] if r % 2 == 0 else ["reference", "recipe"]  # no side always first
            for kind in order:
                if kind == "reference" and not has_reference(w):
                    continue
                print(f"repeat {r + 1}/{repeats}: {name} {kind} ...", flush=True)
                run = recipe(name, w, r) if kind == "recipe" else reference(name, w, r)
                runs[name][kind].append(run)
                print(f"    {run['steps_per_second']:.2f} steps/s, first step {run['first_step_s']:.1f} s, load "
                      f"average {run['load_average_1min']:.1f}", flush=True)
        if after_repeat:
            after_repeat(r)
    return runs


def summarize(runs, targets):
    """Medians; a recipe's ratio is the median of its per-repeat ratios (each pair ran back to back). Workloads
    that ran without a reference loop are left out (recipe_only)."""
    workloads = {}
    for name, pair in runs.items():
        recipe, reference = pair["recipe"], pair["reference"]
        if not reference:
            continue
        ratios = [r["steps_per_second"] / f["steps_per_second"] for r, f in zip(recipe, reference)]
        cpu_ratios = (None if median_of(recipe + reference, "steps_per_cpu_second") is None else
                      [r["steps_per_cpu_second"] / f["steps_per_cpu_second"] for r, f in zip(recipe, reference)])
        workloads[name] = {
            "recipe": {key: median_of(recipe, key) for key in recipe[0]},
            "reference": {key: median_of(reference, key) for key in reference[0]},
            "ratio_to_reference": statistics.median(ratios), "ratios": ratios,
            "cpu_time_ratio_to_reference": cpu_ratios and statistics.median(cpu_ratios),
            "pass": statistics.median(ratios) >= targets["min_ratio_to_reference"], "runs": pair}
    return workloads


def recipe_only(runs):
    """Medians of the workloads that ran without a reference loop."""
    return {name: {"recipe": {key: median_of(pair["recipe"], key) for key in pair["recipe"][0]}, "runs": pair["recipe"]}
            for name, pair in runs.items() if not pair["reference"]}


def bucket_ratio(runs, targets):
    """lora_buckets' steps/s against lora_square's: the median of the per-repeat ratios (each pair in one repeat);
    the same of steps per CPU second beside it (less moved by other jobs on the machine)."""
    pairs = list(zip(runs[BUCKETS]["recipe"], runs[SQUARE]["recipe"]))
    ratios = [b["steps_per_second"] / s["steps_per_second"] for b, s in pairs]
    cpu_ratios = (None if median_of(runs[BUCKETS]["recipe"] + runs[SQUARE]["recipe"], "steps_per_cpu_second") is None
                  else [b["steps_per_cpu_second"] / s["steps_per_cpu_second"] for b, s in pairs])
    ratio = statistics.median(ratios)
    medians = {name: median_of(runs[name]["recipe"], "steps_per_second") for name in (BUCKETS, SQUARE)}
    return {"ratio": ratio, "ratios": ratios, "pass": ratio >= targets["min_bucket_ratio"], "steps_per_second": medians,
            "cpu_time_ratio": cpu_ratios and statistics.median(cpu_ratios), "cpu_time_ratios": cpu_ratios}


def markdown_table(header, rows):
    """Aligned markdown (pasteable into docs/performance.md)."""
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]

    def line(row):
        return "| " + " | ".join(str(c).ljust(wd) for c, wd in zip(row, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (wd + 2) for wd in widths) + "|", *map(line, rows)])


def table(results):
    """One markdown table (pasteable into docs/performance.md)."""
    t = results["targets"]
    header = ["what", "recipe", "reference loop", "ratio", "target", "ok", "samples/s", "peak RSS MB (ref)",
              "first step s (ref)"]
    rows = []
    ok = {True: "yes", False: "**no**"}
    for name, w in results["workloads"].items():
        r, f = w["recipe"], w["reference"]
        rows.append([name, f"{r['steps_per_second']:.2f} steps/s", f"{f['steps_per_second']:.2f} steps/s",
                     f"{w['ratio_to_reference']:.3f}", f">= {t['min_ratio_to_reference']}", ok[w["pass"]],
                     f"{r['samples_per_second']:.0f}", f"{r['peak_rss_mb']:.0f} ({f['peak_rss_mb']:.0f})",
                     f"{r['first_step_s']:.1f} ({f['first_step_s']:.1f})"])
    if "lora_cache_speedup" in results:
        s = results["lora_cache_speedup"]
        rows.append(["lora cached / uncached", f"{s['recipe']:.2f}x", f"{s['reference']:.2f}x", "",
                     f">= {t['min_lora_cache_speedup']}x", ok[s["pass"]], "", "", ""])
    data_path = results.get("data_path", {})
    for name, w in results.get("recipe_only", {}).items():
        r, pixels = w["recipe"], data_path.get(name, {}).get("pixels_per_sample")
        rows.append([name if pixels is None else f"{name} ({pixels:.0f} px a sample)",
                     f"{r['steps_per_second']:.2f} steps/s", "none", "", "", "", f"{r['samples_per_second']:.0f}",
                     f"{r['peak_rss_mb']:.0f}", f"{r['first_step_s']:.1f}"])
    if "bucket_ratio" in results:
        b = results["bucket_ratio"]
        cpu = "" if b.get("cpu_time_ratio") is None else f"per CPU second: {b['cpu_time_ratio']:.3f}"
        rows.append(["lora buckets / square", f"{b['steps_per_second'][BUCKETS]:.2f} / "
                     f"{b['steps_per_second'][SQUARE]:.2f} steps/s", cpu, f"{b['ratio']:.3f}",
                     f">= {t['min_bucket_ratio']}", ok[b["pass"]], "", "", ""])
    timed = [name for name in (BUCKETS, SQUARE) if "random_flip_off" in data_path.get(name, {})]
    for flip in ("off", "on") if timed else ():
        us = [data_path[name][f"random_flip_{flip}"]["median_us"] for name in timed]
        rows.append([f"data path, a batch of {data_path[timed[0]]['batch_size']}"
                     f"{', --random_flip' if flip == 'on' else ''}: "
                     + " / ".join({BUCKETS: "buckets", SQUARE: "square"}[name] for name in timed),
                     " / ".join(f"{u:.0f}" for u in us) + " us", "", f"{us[0] / us[1]:.2f}" if len(us) == 2 else "",
                     "", "", "", "", ""])
    if "sample" in results:
        s = results["sample"]
        rows.append([f"sample.py {s['num_images']} images x {s['steps']} steps",
                     f"{s['images_per_second']:.2f} images/s end to end ({s['wall_s']:.1f} s)",
                     f"{s['sampling_images_per_second']:.1f} images/s sampling only ({s['sampling_s']:.1f} s)",
                     "", "", "", "", "", ""])
    for script, h in results.get("help", {}).items():
        rows.append([f"{script} --help", f"{h['median_s']:.2f} s", "", "", f"<= {t['max_help_seconds']} s",
                     ok[h["median_s"] <= t["max_help_seconds"]], "", "", ""])
    return markdown_table(header, rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(HERE, "workloads.toml"))
    parser.add_argument("--repeats", type=int, default=None, help="Default: the config's (3).")
    parser.add_argument("--only", default=None, help="Comma-separated workload names (default: all).")
    parser.add_argument("--no_sample", action="store_true")
    parser.add_argument("--no_help", action="store_true")
    parser.add_argument("--no_data_path", action="store_true",
                        help="Do not time lora_buckets' and lora_square's data path (their pixel counts still).")
    args = parser.parse_args()
    with open(args.config, "rb") as f:
        config = tomllib.load(f)
    repeats = args.repeats or config["repeats"]
    names = args.only.split(",") if args.only else list(config["workloads"])
    env = bench_env(config)
    launcher = accelerate_cli()
    os.makedirs(os.path.join(OUT, "logs"), exist_ok=True)
    results = {"machine": machine_facts(), "command": shlex.join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
               "repeats": repeats, "targets": config["targets"],
               "launch": " ".join(["accelerate", *config["launch"]]), "env": config["env"]}

    if not args.no_help:
        print("--help latency ...", flush=True)
        results["help"] = help_latency(config, env)
    bucketed = [name for name in (BUCKETS, SQUARE) if name in names]
    if bucketed:  # their images (once), then their data path, in this process
        mixed = config["mixed_aspect"]
        if mixed_aspect.write_mixed_aspect(os.path.join(ROOT, mixed["source"]), os.path.join(ROOT, mixed["output"]),
                                           mixed["canvases"]):
            print(f"wrote {mixed['output']} (the digits on {', '.join(f'{w}x{h}' for w, h in mixed['canvases'])} "
                  "canvases)", flush=True)
        results["data_path"] = {}
        for name in bucketed:
            print(f"data path: {name} ...", flush=True)
            batches = 0 if args.no_data_path else config["data_path"]["batches"]
            results["data_path"][name] = cost = mixed_aspect.data_path_cost(config["workloads"][name]["args"],
                                                                            batches)
            timed = [f"--random_flip {flip}: {cost[f'random_flip_{flip}']['median_us']:.0f} us a batch"
                     for flip in ("off", "on") if f"random_flip_{flip}" in cost]
            print(f"    {cost['pixels_per_sample']:.0f} px a sample; {', '.join(timed)}", flush=True)
    samples = []

    def after_repeat(r):
        if "ddpm" in names and not args.no_sample:  # sample.py on this repeat's DDPM output
            samples.append(sample_run(config, env, r))
            print(f"repeat {r + 1}/{repeats}: sample.py: {samples[-1]['wall_s']:.1f} s, of which sampling "
                  f"{samples[-1]['sampling_s']:.1f} s", flush=True)

    runs = run_workloads(config, names, repeats, lambda name, w, r: recipe_run(name, w, config, launcher, env, r),
                         lambda name, w, r: reference_run(name, w, env, r), after_repeat)

    t = config["targets"]
    results["workloads"] = summarize(runs, t)
    if recipe_only(runs):
        results["recipe_only"] = recipe_only(runs)
    if {BUCKETS, SQUARE} <= set(names):
        results["bucket_ratio"] = bucket_ratio(runs, t)
    if {"lora_cached", "lora_uncached"} <= set(names):
        speedup = {kind: statistics.median(c["steps_per_second"] / u["steps_per_second"] for c, u in
                                           zip(runs["lora_cached"][kind], runs["lora_uncached"][kind]))
                   for kind in ("recipe", "reference")}
        results["lora_cache_speedup"] = {**speedup, "pass": speedup["recipe"] >= t["min_lora_cache_speedup"]}
    if samples:
        results["sample"] = {"num_images": config["sample"]["num_images"], "steps": config["sample"]["steps"],
                             **{key: median_of(samples, key) for key in samples[0]}, "runs": samples}
    results["machine"]["load_average_at_end"] = os.getloadavg()
    results["table"] = table(results)
    with open(os.path.join(OUT, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    m = results["machine"]
    print(f"\n{m['cpu']}, {m['cores']} cores, torch {m['torch']}, {m['date']}, load average "
          f"{m['load_average_at_start'][0]:.1f} -> {m['load_average_at_end'][0]:.1f}; medians of {repeats} repeats\n")
    print(results["table"])
    print(f"\nwritten to {os.path.relpath(os.path.join(OUT, 'results.json'), ROOT)}")


if __name__ == "__main__":
    main()
