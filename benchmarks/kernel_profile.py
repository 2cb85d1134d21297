"""Kernel tables from a ``torch.profiler`` profile: where a step's device time goes.

Two views of the same profile, used by the profile scripts:

- `per_step` (profile_train_step, profile_generate): per kernel and per `family` from the
  chrome trace's events (`trace_events`, `device_trace_events`);
- `step_profile` (bench_ep ``--profile``): the profile's own events (`kernels`) grouped
  by `kernel_class` (transport, GEMM, Triton by name, reductions, copies, other), with count
  and time per step, the streams each class ran on, and how long the transport's kernels
  ran concurrently with the others (`overlap_us`), against the step's busy and wall time.

On the CPU (a smoke run) the profile has no kernels: the ops stand in for them, each
with the time of its own (its interval less its children's), the thread as its stream.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import tempfile

import torch

# Kernel families by name, first match wins: (family, pattern).
FAMILIES = (
    ("our Triton", re.compile(r"^moe_")),
    ("Inductor", re.compile(r"^triton_")),
    ("copy/set", re.compile(r"^Memcpy|^Memset|copy_kernel|fill_kernel", re.IGNORECASE)),
    ("sort", re.compile(r"sort|radix|cub::", re.IGNORECASE)),
    ("GEMM", re.compile(r"gemm|cutlass|nvjet|sm90_|cublas|wgmma", re.IGNORECASE)),
    ("ATen other", re.compile(r"at::native|at_cuda_detail", re.IGNORECASE)),
)
# Trace categories of GPU work: kernels, copies and sets.
GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}


def family(name: str) -> str:
    return next((label for label, pattern in FAMILIES if pattern.search(name)), "other")


def busy_us(intervals) -> float:
    """Length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def per_step(events: list[dict], steps: int) -> dict:
    """What ``steps`` steps' GPU events (trace events with ``ts``, ``dur``, ``name``)
    come to per step: ``busy_ms`` (the union of their intervals), ``kernels``, ms per
    kernel ``family`` and ``top``: (ms, calls, name) per kernel, most time first."""
    per_kernel = collections.defaultdict(lambda: [0.0, 0])
    per_family = collections.Counter()
    for e in events:
        per_kernel[e["name"]][0] += e["dur"]
        per_kernel[e["name"]][1] += 1
        per_family[family(e["name"])] += e["dur"]
    return {"busy_ms": busy_us([(e["ts"], e["ts"] + e["dur"]) for e in events]) / 1e3 / steps,
            "kernels": len(events) / steps,
            "families": {k: v / 1e3 / steps for k, v in per_family.items()},
            "top": sorted(((total / 1e3 / steps, count / steps, kernel)
                           for kernel, (total, count) in per_kernel.items()), reverse=True)}


def trace_events(prof) -> list[dict]:
    """The chrome trace events of a finished profile."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]


def device_trace_events(events: list[dict], smoke: bool) -> list[dict]:
    """The trace's GPU kernels, copies and sets (on ``smoke``, a CPU run: its ops)."""
    wanted = {"cpu_op"} if smoke else GPU_CATEGORIES
    return [e for e in events if e.get("cat") in wanted and "dur" in e]


# --- Classes of bench_ep --profile -------------------------------------------------------

# Kernel classes by name, first match wins: (class, pattern). Transport classes come first
# (`TRANSPORT_CLASSES`); Triton kernels (Inductor's ``triton_*``, ours ``moe_*``...) are each a
# class of their own, named by the kernel (an op's name, ``moe_x::y``, is not one). On the
# CPU the ops' names (aten::mm, gloo:...).
TRANSPORT_CLASSES = ("NCCL", "DeepEP", "FlashInfer a2a")
CLASSES = (
    ("NCCL", re.compile(r"nccl|^gloo:|^c10d::|record_param_comms", re.IGNORECASE)),
    ("DeepEP", re.compile(r"deep_ep|nvshmem", re.IGNORECASE)),
    ("FlashInfer a2a", re.compile(r"moeA2A|moe_a2a|MoeAlltoAll", re.IGNORECASE)),
    # Inductor's and ours (moe_*, fp8_*_kernel, _*_kernel): a Triton GEMM keeps its name.
    ("Triton", re.compile(r"^(triton_\w*|moe_\w*|fp8_\w*_kernel|_\w+_kernel)$")),
    ("GEMM", re.compile(r"gemm|cutlass|nvjet|sm90_|sm100_|cublas|wgmma|aten::(mm|bmm|addmm|"
                        r"_grouped_mm|matmul|linear)$", re.IGNORECASE)),
    ("sort/topk", re.compile(r"sort|radix|topk|cub::", re.IGNORECASE)),
    ("reduction/sum", re.compile(r"reduce|sum|scatter_add|index_add", re.IGNORECASE)),
    ("copy/pack/gather/index", re.compile(r"^Memcpy|^Memset|copy|fill|gather|scatter|index|"
                                          r"CatArray|aten::(cat|stack|to|_to_copy|empty|empty_like|"
                                          r"zeros|new_empty|empty_strided|view|reshape)$",
                                          re.IGNORECASE)),
)


def kernel_class(name: str) -> str:
    label = next((label for label, pattern in CLASSES if pattern.search(name)), "other")
    if label == "Triton":
        return f"Triton {name}"
    if label in TRANSPORT_CLASSES:
        # Each transport kernel on its own (DeepEP's layout, notify, dispatch and combine;
        # NCCL's count exchange apart from its data): which of them a gap is made of.
        return f"{label} {short_kernel_name(name)}"
    return label


def short_kernel_name(name: str) -> str:
    """A kernel's name without its signature, template arguments and return type:
    ``void deep_ep::intranode::dispatch<8, 768>(int4*)`` is ``intranode::dispatch``."""
    bare = re.split(r"[(<]", name.removeprefix("void "), maxsplit=1)[0].strip()
    return bare.removeprefix("deep_ep::") or name


def is_transport(label: str) -> bool:
    """Whether a class of `kernel_class` is a transport's kernel."""
    return label.startswith(TRANSPORT_CLASSES)


@dataclasses.dataclass(frozen=True)
class Kernel:
    """One kernel (or CPU op) of a profile: its name, the stream (CPU: thread) it ran on,
    and the intervals, microseconds, it ran in (a CPU op: its own time, children left out)."""

    name: str
    stream: int
    intervals: tuple[tuple[float, float], ...]

    @property
    def us(self) -> float:
        return sum(end - start for start, end in self.intervals)


def kernels(prof, device: bool) -> tuple[list[Kernel], list[str]]:
    """The kernels of a finished ``torch.profiler.profile`` from its own events
    (``prof.events()``: name, device type, interval, ``device_resource_id``, the stream of
    a device event and the thread of a CPU one), and notes on what could not be read.
    ``device``: the CUDA kernels, copies and sets; else (a CPU run) the CPU ops, each with
    its own time."""
    notes = []
    events = list(prof.events())
    if device:
        cpu_names = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}
        found = []
        for e in events:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            activity = getattr(e, "activity_type", None)
            # The profiler mirrors record_function ranges on the device (gpu_user_annotation):
            # by their activity where the events carry it, else by their CPU twin's name.
            if activity is not None and "annotation" in str(activity):
                continue
            if activity is None and e.name in cpu_names:
                continue
            stream = getattr(e, "device_resource_id", None)
            if stream is None:
                stream = -1
            found.append(Kernel(e.name, int(stream),
                                ((e.time_range.start, e.time_range.end),)))
        if found and all(k.stream == -1 for k in found):
            notes.append("this torch's profile events carry no stream")
        if not found:
            notes.append("no CUDA kernels in the profile")
        return found, notes
    found = []
    for e in events:
        # A scheduled profile wraps each step in a ProfilerStep range: no op of the run.
        if e.device_type != torch.autograd.DeviceType.CPU or e.name.startswith("ProfilerStep#"):
            continue
        start, end = e.time_range.start, e.time_range.end
        children = sorted((c.time_range.start, c.time_range.end) for c in e.cpu_children)
        own, cursor = [], start
        for child_start, child_end in children:
            if child_start > cursor:
                own.append((cursor, min(child_start, end)))
            cursor = max(cursor, child_end)
        if end > cursor:
            own.append((cursor, end))
        found.append(Kernel(e.name, int(e.thread), tuple(own)))
    return found, notes


def intersection_us(a, b) -> float:
    """Length of (the union of intervals ``a``) intersected with (the union of ``b``)."""
    a, b = list(a), list(b)
    return max(0.0, busy_us(a) + busy_us(b) - busy_us(a + b))


def overlap_us(found: list[Kernel]) -> float:
    """How long a transport kernel ran while another kernel ran (two kernels that run at
    the same time run on two streams)."""
    transport, rest = [], []
    for k in found:
        (transport if is_transport(kernel_class(k.name)) else rest).extend(k.intervals)
    return intersection_us(transport, rest)


def step_profile(found: list[Kernel], steps: int, wall_us: float | None = None) -> dict:
    """``steps`` steps' kernels per step: per class (most time first) ``count``, ``us`` and
    ``streams``, and ``with_transport_us`` (its time concurrent with a transport kernel);
    the step's ``busy_us`` (the union of all kernels' intervals) and ``span_us`` (first start
    to last end), and where a transport ran, ``transport_us`` (the union of its kernels),
    ``overlap_us`` (how much of that ran concurrently with another kernel) and
    ``exposed_transport_us`` (the rest). ``wall_us``: the step's timed wall time, kept
    beside them."""
    classes: dict[str, dict] = {}
    for k in found:
        entry = classes.setdefault(kernel_class(k.name), {"count": 0, "us": 0.0,
                                                          "streams": set(), "intervals": []})
        entry["count"] += 1
        entry["us"] += k.us
        entry["streams"].add(k.stream)
        entry["intervals"].extend(k.intervals)
    transport = [i for label, e in classes.items() if is_transport(label)
                 for i in e["intervals"]]
    everything = [i for k in found for i in k.intervals]
    table = []
    for label, e in sorted(classes.items(), key=lambda item: -item[1]["us"]):
        concurrent = (None if is_transport(label) or not transport
                      else intersection_us(e["intervals"], transport) / steps)
        table.append({"class": label, "count": e["count"] / steps, "us": e["us"] / steps,
                      "streams": sorted(e["streams"]), "with_transport_us": concurrent})
    result = {"steps": steps, "classes": table, "kernels": len(found) / steps,
              "busy_us": busy_us(everything) / steps,
              "span_us": ((max(end for _, end in everything)
                           - min(start for start, _ in everything)) / steps
                          if everything else 0.0),
              "wall_us": wall_us}
    if transport:
        shared = overlap_us(found)
        result.update(transport_us=busy_us(transport) / steps, overlap_us=shared / steps,
                      exposed_transport_us=(busy_us(transport) - shared) / steps)
    return result


def _cell(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def step_table(profile: dict, unit: str = "GPU") -> str:
    """`step_profile`'s result as markdown: one line of totals, one row per class."""
    summary = (f"per step ({profile['steps']} profiled): {unit} busy "
               f"{profile['busy_us']:.1f} us of a {profile['span_us']:.1f} us span "
               f"(first kernel start to last end), timed wall {_cell(profile['wall_us'])} us; "
               f"{profile['kernels']:.1f} kernels")
    if "transport_us" in profile:
        summary += (f"; transport {profile['transport_us']:.1f} us, of it concurrent with "
                    f"other kernels (overlap) {profile['overlap_us']:.1f} us, exposed "
                    f"{profile['exposed_transport_us']:.1f} us")
    lines = [summary, "", "| class | count | us | streams | us concurrent with transport |",
             "|---|---|---|---|---|"]
    for row in profile["classes"]:
        lines.append(f"| {row['class'][:90]} | {row['count']:.1f} | {row['us']:.1f} | "
                     f"{', '.join(map(str, row['streams']))} | "
                     f"{_cell(row['with_transport_us'])} |")
    return "\n".join(lines + [f"Note: {n}" for n in profile.get("notes", [])])
