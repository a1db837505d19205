"""benchmark/offline/timeline.py: the idle-gap arithmetic on a made-up trace, the busy time and
kernel kinds that bench.py --profile prints, and a CPU smoke run of the script on a tiny model."""

import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))

from timeline import (  # noqa: E402
    Gap,
    busy_by_slice,
    device_ops,
    gaps_by_next_kind,
    host_during,
    idle_gaps,
    kernel_groups,
    per_kernel,
)


def op(name: str, ts: float, dur: float) -> dict:
    return {"name": name, "cat": "kernel", "ts": ts, "dur": dur}


def test_busy_is_the_union_and_gaps_name_their_neighbours():
    # b overlaps a (a PDL launch), c is inside b, then 5 us of nothing before d
    ops = [op("a", 0, 4), op("b", 2, 6), op("c", 3, 1), op("d", 13, 2)]
    busy, span, gaps = idle_gaps(ops)
    assert (busy, span) == (10, 15)
    assert [(g.start, g.length, g.before, g.after) for g in gaps] == [(8, 5, "b", "d")]
    assert idle_gaps([]) == (0.0, 0.0, [])


def test_host_during_names_the_longest_host_work_over_a_gap():
    gap = Gap(10.0, 5.0, "a", "b")
    host = [op("aten::tensor", 2, 9), op("cudaLaunchKernel", 14, 1), op("aten::index", 16, 3)]
    host.append(op("cudaStreamSynchronize", 11, 30))
    assert host_during(host, gap) == "cudaStreamSynchronize:30 aten::tensor:9 cudaLaunchKernel:1"
    assert host_during([], gap) == "-"


def test_per_kernel_counts_launches_per_step_and_sorts_by_total_time():
    ops = [op("gemv", 0, 2), op("gemv", 3, 2), op("norm", 6, 1), op("gemv", 8, 2)]
    rows = per_kernel(ops, steps=2)
    assert rows == [("gemv", 1.5, 2.0), ("norm", 0.5, 1.0)]


def test_busy_by_slice_places_the_idle_time_in_the_run():
    """Two slices of 10 us: the first busy 8 us (an extend kernel 0-6 and a 2 us norm 8-10),
    the second 5 us, with a decode kernel crossing the boundary counted in both."""
    ops = [
        op("_extend_kernel", 0, 6),
        op("_rms_norm_kernel", 8, 2),
        op("_decode_split_kernel", 10, 3),
        op("Memcpy HtoD", 18, 2),
    ]
    assert busy_by_slice(ops, slices=2) == [(0.8, "extend attention"), (0.5, "decode attention")]
    ops[2] = op("_decode_split_kernel", 7, 6)  # 3 us in the first slice (over the norm), 3 after
    ops.sort(key=lambda o: o["ts"])
    assert busy_by_slice(ops, slices=2) == [(0.9, "extend attention"), (0.5, "decode attention")]
    assert busy_by_slice([]) == []


class FakeKinetoEvent:
    """What device_ops reads of torch's `_KinetoEvent`."""

    def __init__(self, activity: str, start_us: float, dur_us: float) -> None:
        self.activity, self.start, self.dur = activity, start_us, dur_us

    def name(self) -> str:
        return "op"

    def activity_type(self) -> str:
        return self.activity

    def start_ns(self) -> int:
        return int(self.start * 1000)

    def duration_ns(self) -> int:
        return int(self.dur * 1000)


def device_busy_s(kineto_events) -> float:
    """bench.py --profile's GPU busy seconds."""
    return idle_gaps(device_ops(kineto_events))[0] / 1e6


def test_gpu_busy_is_the_union_of_device_intervals():
    # two kernels overlapping under PDL count once; a copy counts; the host's ops, an
    # annotation's GPU range and the 3 us gap do not; torch may list the events unsorted
    events = [
        FakeKinetoEvent("kernel", 10, 5),
        FakeKinetoEvent("cpu_op", 0, 100),
        FakeKinetoEvent("gpu_user_annotation", 0, 100),
        FakeKinetoEvent("kernel", 0, 4),
        FakeKinetoEvent("kernel", 2, 4),
        FakeKinetoEvent("gpu_memcpy", 6, 1),
    ]
    assert abs(device_busy_s(events) - 12e-6) < 1e-12
    assert device_busy_s([FakeKinetoEvent("cuda_runtime", 0, 5)]) == 0.0
    # torch 2.11's events give only the device (and whether they are annotations)
    older = [OlderKinetoEvent(e.activity, e.start, e.dur) for e in events]
    assert abs(device_busy_s(older) - 12e-6) < 1e-12


class OlderKinetoEvent(FakeKinetoEvent):
    """torch 2.11's `_KinetoEvent`: no activity_type, a device type instead."""

    def __getattribute__(self, name: str) -> Any:
        if name == "activity_type":
            raise AttributeError(name)
        return super().__getattribute__(name)

    def device_type(self) -> Any:
        from torch.autograd import DeviceType

        host = self.activity in ("cpu_op", "cuda_runtime")
        return DeviceType.CPU if host else DeviceType.CUDA

    def is_user_annotation(self) -> bool:
        return self.activity == "gpu_user_annotation"


def test_kernel_groups_sum_by_kind():
    seconds = {
        "_decode_split_kernel": 4.0,
        "_decode_merge_kernel": 0.5,
        "nvjet_sm90_tst_64x32_64x16_4x2_h_bz_TNT": 0.25,
        "_gemv_kernel": 0.125,
        "_rms_norm_kernel": 0.125,
        "Memcpy HtoD (Pinned -> Device)": 0.0625,
        "void at::native::vectorized_elementwise_kernel<4>": 0.0625,
    }
    assert kernel_groups(seconds) == [
        ("decode attention", 4.5), ("GEMM", 0.25), ("GEMV", 0.125), ("norm", 0.125),
        ("copies", 0.0625), ("other", 0.0625),
    ]  # fmt: skip


def test_cpu_smoke_run():
    script = os.path.join(ROOT, "benchmark", "offline", "timeline.py")
    res = subprocess.run(
        [sys.executable, script, "--tiny", "--device", "cpu", "--tokens", "4"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "tok/s (profiled)" in res.stdout and "no device activity" in res.stdout


def test_gaps_group_by_the_kind_of_op_after_them():
    gaps = [
        Gap(0, 2.0, "_rms_norm_kernel", "nvjet_sm90_tst_64x32"),
        Gap(5, 1.5, "_decode_split_kernel", "nvjet_sm90_tst_128x64"),
        Gap(9, 0.5, "nvjet_sm90_tst_64x32", "_rms_norm_kernel"),
        Gap(12, 4.0, "_pick_kernel", "Memcpy HtoD (Pinned -> Device)"),
    ]
    assert gaps_by_next_kind(gaps) == [("copies", 1, 4.0), ("GEMM", 2, 3.5), ("norm", 1, 0.5)]


def test_steps_end_at_their_copy_and_say_whether_the_host_was_ahead():
    from timeline import Step, steps_of

    def launched(event: dict, correlation: int, at: float) -> list[dict]:
        event["args"] = {"correlation": correlation}
        return [event, {"name": "cudaLaunchKernel", "cat": "cuda_runtime", "ts": at, "dur": 1,
                        "args": {"correlation": correlation}}]  # fmt: skip

    copy = {"name": "Memcpy DtoH (Device -> Pinned)", "cat": "gpu_memcpy"}
    # step 1: launched 0-20 us, run 50-90 (the host 50 us ahead); step 2: its first op
    # launched at 95 and run at 95 (the GPU waited), then 5 us idle inside it
    events = launched(op("a", 50, 30), 1, 0) + launched(op("b", 80, 5), 2, 10)
    events += launched({**copy, "ts": 85, "dur": 5}, 3, 20)
    events += launched(op("c", 95, 10), 4, 95) + launched({**copy, "ts": 110, "dur": 2}, 5, 99)
    events.append(op("d", 200, 1))  # a step not ended by its copy yet is left out
    assert steps_of(events) == [Step(3, 40, 40, 20, 50), Step(2, 17, 12, 4, 0)]


def test_step_report_groups_steps_by_their_op_count(capsys):
    from timeline import Step, report_steps

    eager = [Step(344, 24_000, 20_000, 23_000, lead) for lead in (0, 5_000)]
    report_steps([Step(264, 5_000, 4_900, 1_400, 4_000)] * 3 + eager)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("5 steps")
    assert (
        lines[1].split()
        == "344 ops x 2: 24.00 20.00 23.00 the host behind at the start of 1".split()
    )
    assert lines[2].split()[:3] == ["264", "ops", "x"] and lines[2].endswith("of 0")
