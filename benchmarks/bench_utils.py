"""Measurement helpers shared by `bench_inference.py` (hf_elmo) and `allennlp_peer.py` (AllenNLP 0.9.0).

Both sides time, count and describe the machine with these same functions, so their JSON lines mean the same
thing. Only the standard library and torch are imported here: the peer's process must not load hf_elmo or
transformers, or its memory figures would include them.
"""

import ctypes
import gc
import os
import platform
import re
import resource
import statistics
import time

import torch


# ---------------------------------------------------------------------------------------------------------------
# The machine
# ---------------------------------------------------------------------------------------------------------------
# /proc/cpuinfo flags worth reporting for matmul speed: the vector units and the bf16 / int8 matrix extensions.
_VECTOR_FLAG = re.compile(r"^(avx\S*|amx\S*|fma|f16c|sse4_2)$")


def cpu_description() -> dict:
    """The CPU's model name, vendor, family/model, core count and its vector extensions (from /proc/cpuinfo)."""
    fields, flags = {}, set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                key, value = key.strip(), value.strip()
                if key in ("flags", "Features"):
                    flags = set(value.split())
                else:
                    fields.setdefault(key, value)
    except OSError:
        pass
    vector = sorted(f for f in flags if _VECTOR_FLAG.match(f))
    return {
        "model": fields.get("model name") or platform.processor() or platform.machine(),
        "vendor": fields.get("vendor_id"),
        "family_model_stepping": [fields.get("cpu family"), fields.get("model"), fields.get("stepping")],
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "vector_extensions": vector,
        "avx512": "avx512f" in flags,
        "avx512_bf16": "avx512_bf16" in flags,
        "amx": sorted(f for f in flags if f.startswith("amx")),
    }


def blas_description() -> dict:
    """Which BLAS and oneDNN torch was built with, and which CPU kernels it dispatches to."""
    shown = torch.__config__.show()
    blas = re.search(r"BLAS_INFO=([^,\s]+)", shown)
    libraries = [
        line.strip(" -")
        for line in shown.splitlines()
        if re.search(r"Math Kernel Library|OpenBLAS|BLIS|Accelerate|MKL-DNN|oneDNN|LAPACK is", line)
    ]
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except AttributeError:
        capability = None
    return {
        "blas": blas.group(1) if blas else None,
        "libraries": libraries,
        "mkl_available": torch.backends.mkl.is_available(),
        "mkldnn_available": torch.backends.mkldnn.is_available(),
        "mkldnn_enabled": bool(torch.backends.mkldnn.enabled),
        "cpu_capability": capability,
    }


def machine_description(device: str) -> dict:
    """Everything a figure needs beside it to be read: CPU, BLAS, threads, GPU (on cuda), versions."""
    description = {
        "cpu": cpu_description(),
        "blas": blas_description(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }
    # Settings that change how the BLAS and OpenMP threads behave (e.g. OMP_WAIT_POLICY=PASSIVE on a shared host).
    description["env"] = {k: v for k, v in sorted(os.environ.items())
                          if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "DNNL_", "ONEDNN_"))}
    if device == "cuda":
        properties = torch.cuda.get_device_properties(0)
        description["gpu"] = {
            "name": torch.cuda.get_device_name(0),
            "memory_gib": round(properties.total_memory / 2**30, 1),
            "capability": list(torch.cuda.get_device_capability(0)),
            "cuda": torch.version.cuda,
        }
    return description


# ---------------------------------------------------------------------------------------------------------------
# Memory
# ---------------------------------------------------------------------------------------------------------------
def proc_status_mib(key: str) -> float | None:
    """A `/proc/self/status` memory field (VmRSS, VmHWM, ...) in MiB, or None where there is no /proc."""
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Restart VmHWM (the peak RSS) from the current RSS; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def release_freed_memory():
    """
    Give the heap that loading freed back to the OS (glibc keeps it otherwise), so that the peak measured
    afterwards counts what inference holds, not what the loader once held. Done the same way on both sides.
    """
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def gpu_memory_peaks() -> dict:
    """Peak CUDA memory allocated and reserved since the last `torch.cuda.reset_peak_memory_stats()`, in MiB."""
    return {"peak_gpu_memory_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1),
            "peak_gpu_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20, 1)}


def process_peak_rss_mib() -> float:
    """The whole process's peak RSS (loading included), from getrusage."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------------------------------------------
# A quiet machine
# ---------------------------------------------------------------------------------------------------------------
def cpu_busy_fraction(interval: float = 0.5) -> float:
    """Fraction of all CPUs busy (any process) over `interval` seconds, from /proc/stat."""

    def sample():
        with open("/proc/stat") as handle:
            values = [int(v) for v in handle.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(interval)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def wait_until_quiet(timeout_s: float, threshold: float = 0.15) -> float | None:
    """Wait up to `timeout_s` until other processes use less than `threshold` of the CPUs; the last reading."""
    if timeout_s <= 0:
        return None
    try:
        deadline = time.time() + timeout_s
        busy = cpu_busy_fraction()
        while busy > threshold and time.time() < deadline:
            busy = cpu_busy_fraction()
        return round(busy, 3)
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# A tiny biLM
# ---------------------------------------------------------------------------------------------------------------
# The widths of the GPU benchmarks' tiny biLM (`gpu_report.py --smoke`, `gpu_proxies.py --config tiny`), as
# `ElmoConfig`'s keyword arguments (hf_elmo is not imported here).
TINY_BILM = dict(char_filters=[[1, 4], [2, 4], [3, 8]], n_highway=1, char_embedding_dim=4, lstm_dim=24,
                 projection_dim=8, cell_clip=3.0, proj_clip=3.0, num_lstm_layers=2)


# ---------------------------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------------------------
class PartTimer:
    """Wall time spent inside chosen submodules (char CNN, biLSTM), through forward pre/post hooks."""

    def __init__(self, synchronize=None):
        self.seconds: dict[str, float] = {}
        self._started: dict[str, float] = {}
        self._synchronize = synchronize or (lambda: None)

    def watch(self, name: str, module: torch.nn.Module):
        self.seconds[name] = 0.0

        def before(_module, _inputs):
            self._synchronize()
            self._started[name] = time.perf_counter()

        def after(_module, _inputs, _output):
            self._synchronize()
            self.seconds[name] += time.perf_counter() - self._started[name]

        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)

    def wrap(self, name: str, function):
        """`function`, counting its wall time under `name` (for code that does not go through a module's forward)."""
        self.seconds.setdefault(name, 0.0)

        def timed(*args, **kwargs):
            self._synchronize()
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._synchronize()
                self.seconds[name] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        """The seconds counted since the last call, and a fresh start."""
        taken = dict(self.seconds)
        for name in self.seconds:
            self.seconds[name] = 0.0
        return taken


def time_passes(run_batch, n_batches: int, repeats: int, parts: PartTimer, wait_quiet_s: float = 0.0,
                before_pass=None, synchronize=None) -> dict:
    """
    One untimed warm-up call on batch 0, then `repeats` timed passes over all batches, in order.

    `run_batch(i)` runs batch i. `before_pass()` (optional) runs before every pass, untimed (the peer resets its
    LSTM state there, so every pass computes the same thing). `synchronize()` (cuda) is called before reading the
    clock. Returns per pass and per batch wall times and the part split of each batch.
    """
    synchronize = synchronize or (lambda: None)
    if before_pass:
        before_pass()
    synchronize()
    start = time.perf_counter()
    run_batch(0)
    synchronize()
    warmup = time.perf_counter() - start
    parts.take()
    records, quiet = [], []  # records[r][i] = (seconds, {part: seconds}, cpu seconds) of pass r, batch i
    for _ in range(repeats):
        quiet.append(wait_until_quiet(wait_quiet_s))
        if before_pass:
            before_pass()
        row = []
        for i in range(n_batches):
            synchronize()
            cpu_start, start = time.process_time(), time.perf_counter()
            run_batch(i)
            synchronize()
            row.append((time.perf_counter() - start, parts.take(), time.process_time() - cpu_start))
        records.append(row)
    return {"records": records, "warmup_s": warmup, "busy_before_passes": quiet}


def summarize(timing: dict, n_words: int) -> dict:
    """
    tokens_per_s = words / the sum over batches of each batch's fastest pass: a busy stretch of a shared machine
    spoils one pass of a batch, rarely all of them. The median and best whole passes are given beside it.
    """
    records = timing["records"]
    passes = [sum(record[0] for record in row) for row in records]
    fastest = [min((row[i] for row in records), key=lambda record: record[0]) for i in range(len(records[0]))]
    total = sum(record[0] for record in fastest)
    cpu = [sum(record[2] for record in row) for row in records]
    split = {}
    for _, parts, _ in fastest:
        for name, seconds in parts.items():
            split[name] = split.get(name, 0.0) + seconds
    split["other"] = total - sum(split.values())
    return {
        "tokens_per_s": round(n_words / total, 1),
        "tokens_per_s_median_pass": round(n_words / statistics.median(passes), 1),
        "tokens_per_s_best_pass": round(n_words / min(passes), 1),
        # Microseconds: a batch of the tiny model takes a few milliseconds on a fast CPU, where rounding to 0.1 ms
        # moved the sum the tokens_per_s above is computed from by over 1% (CI failed on exactly that).
        "pass_s": [round(p, 6) for p in passes],
        "fastest_batch_s": [round(record[0], 6) for record in fastest],
        # Process CPU seconds (all threads) per pass / wall seconds: about the thread count on an idle machine;
        # less where other processes take the CPUs, or where OpenMP threads wait for a preempted partner.
        "cpu_s_per_pass": [round(c, 3) for c in cpu],
        "cpu_over_wall": [round(c / w, 2) for c, w in zip(cpu, passes)],
        "warmup_batch_s": round(timing["warmup_s"], 4),
        "split_s": {name: round(seconds, 6) for name, seconds in split.items()},
        "split_fraction": {name: round(seconds / total, 3) for name, seconds in split.items()},
        "busy_before_passes": timing["busy_before_passes"],
    }


# ---------------------------------------------------------------------------------------------------------------
# Profiling: where a step's or a batch's time goes
# ---------------------------------------------------------------------------------------------------------------
# The CUDA runtime calls that start work on the GPU from the host: one per kernel, one per CUDA graph replay.
_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def profile_keys(per: str) -> tuple[str, ...]:
    """The keys `profile_calls(..., per=per)` returns."""
    return (f"wall_s_per_{per}", f"aten_ops_per_{per}", f"kernels_per_{per}", f"kernel_launches_per_{per}",
            f"graph_replays_per_{per}", f"device_s_per_{per}", "gpu_busy_fraction", f"top_ops_per_{per}")


def profile_calls(run, calls: int, on_gpu: bool, synchronize=None, top: int = 0, per: str = "call") -> dict:
    """
    `run(i)` for i in range(calls) under torch.profiler, between two synchronisations; per call (`per` names it):
    the profiled wall time (the profiler's own host work included: it stretches the wall, not the kernels); the
    aten operator calls, nested ones included (what a CPU can count where a GPU counts kernels); on a GPU
    the kernels run, the kernel launches from the host (a CUDA graph replay counting one, its kernels not), the graph
    replays and the kernels' summed GPU time, and over all calls the fraction of the wall time the GPU was busy
    (`gpu_busy_fraction`, from those). With `top`, the `top` operators by self time (on a GPU the kernels by GPU time,
    those replayed inside CUDA graphs included). Figures a CPU cannot give are None.
    """
    from torch.profiler import ProfilerActivity, profile

    synchronize = synchronize or (lambda: None)
    synchronize()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as profiler:
        for index in range(calls):
            run(index)
        synchronize()
    wall = time.perf_counter() - began
    events = profiler.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA] if on_gpu else None
    launches = [e for e in events if e.name in _LAUNCH_CALLS] if on_gpu else None
    device_s = sum(e.device_time for e in kernels) / 1e6 if on_gpu else None
    per_call = lambda count: None if count is None else round(count / calls, 1)  # noqa: E731
    values = [round(wall / calls, 6), per_call(sum(1 for e in events if e.name.startswith("aten::"))),
              per_call(None if kernels is None else len(kernels)),
              per_call(None if launches is None else len(launches)),
              per_call(None if launches is None else sum(1 for e in launches if e.name == "cudaGraphLaunch")),
              None if device_s is None else round(device_s / calls, 6),
              None if device_s is None else round(device_s / wall, 3)]
    result = dict(zip(profile_keys(per), values))
    if top:
        own_time = (lambda row: row.self_device_time_total) if on_gpu else (lambda row: row.self_cpu_time_total)
        rows = sorted(profiler.key_averages(), key=own_time, reverse=True)[:top]
        result[f"top_ops_per_{per}"] = [{"op": row.key, "self_ms": round(own_time(row) / 1000 / calls, 2),
                                         "calls": round(row.count / calls, 1)} for row in rows]
    return result


def timed_busy_fraction(profiled: dict, per: str, calls: int, timed_s: float) -> float:
    """The GPU's busy fraction over timed work that ran unprofiled: `profile_calls`' GPU time per call (`per` as
    given there; the profiler stretches the host's time, not the kernels') times the `calls` that took `timed_s`."""
    return round(profiled[f"device_s_per_{per}"] * calls / timed_s, 3)
