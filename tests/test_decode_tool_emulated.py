"""``python -m tools.decode``'s GPU path -- the roofline, the step captured as a CUDA graph and timed by events, each
block alone, the read floor, the JSON and the tables -- run end to end on the emulated device
(tests/emulated_device.py) at ``tiny``, so that a GPU run does not find its crashes. The numbers are the CPU's
wall-clock, meaningless as timings: what is checked is that the code path runs and what it records.

Also the emulation's streams and graphs themselves (what the tool relies on): a capture records and a replay runs
what the stream was given, and what a GPU refuses in a capture is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kernels.decode.accounting import BLOCKS
from kernels.decode_reference import generate, prefill
from tests.emulated_device import CUDARuntimeError, EmulatedDevice, OutOfMemoryError, emulated_device

ARGS = ["--model", "tiny", "--context", "40", "--repeats", "2", "--inner", "1"]
SUMMARY = ("samples_us", "median_us", "min_us", "max_us")


def _run(main: Any, argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
    path = tmp_path / "decode.json"
    with emulated_device():
        code = main([*argv, "--json", str(path)])
    out = capsys.readouterr()
    return code, json.loads(path.read_text()), out.out + out.err


def _assert_summary(record: dict[str, Any], samples: int) -> None:
    assert len(record["samples_us"]) == samples and all(s > 0 for s in record["samples_us"])
    assert record["min_us"] <= record["median_us"] <= record["max_us"]


def _assert_timed_point(point: dict[str, Any], repeats: int) -> None:
    """One point as gpu_run records it: smoke checks, the step's samples, every block alone, the read floor."""
    assert point["status"] == "ok", point.get("error")
    assert point["smoke"] == {"tokens_in_range": True, "hidden_finite": True}
    assert (point["model"], point["weight_format"], point["context"]) == ("tiny", "bf16", 40)
    assert (point["distinct_layers"], point["step_layers"]) == (4, 4)
    _assert_summary(point, repeats)
    assert point["tokens_per_s"] == pytest.approx(point["tokens"] / (point["median_us"] * 1e-6))
    assert point["kernels"] == 4 * point["kernels_per_layer"] + 3  # the embedding, the LM head, the lengths bump
    assert point["bytes"]["model"] == "tiny" and point["bytes"]["total"] > 0
    assert list(point["blocks"]) == list(BLOCKS)
    for name, block in point["blocks"].items():
        _assert_summary(block, repeats)
        assert block["bytes"] == point["bytes"]["blocks"][name] > 0
        assert block["pct_roof"] is not None and block["pct_roof"] > 0
    floor = point["read_floor"]
    _assert_summary(floor, repeats)
    assert floor["kernels"] == point["kernels"]  # one streaming read per launch of the step
    assert point["pct_roof"] > 0 and point["pct_floor"] > 0


@pytest.mark.slow
def test_decode_tool_gpu_path_runs_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """T = 3 x MoE strict, warp-decode (the tensor-core path, 8 launches a layer; at T = 1 the policy runs strict's
    kernels), the attention's SPLIT set to 32 (--knob): exit 0, the JSON's schema, every point ok with its smoke
    checks, blocks with their bytes and the read floor, the knob in each point, its label and the attention's grid;
    the tables render."""
    from tools import decode

    argv = [*ARGS, "--tokens", "3", "--moe", "strict,warp-decode", "--knob", "attention.SPLIT=32"]
    path = tmp_path / "decode.json"
    with emulated_device() as device:
        code = decode.main([*argv, "--json", str(path)])
    out = capsys.readouterr()
    data, text = json.loads(path.read_text()), out.out + out.err
    grids = {launch.grid[0] for launch in device.launches if launch.kernel == "decode_attention"}
    assert grids == {-(-(40 + 1 + decode.HEADROOM) // 32)}  # ceil(capacity / SPLIT) chunks
    assert code == 0, text
    assert data["schema"] == decode.SCHEMA and data["complete"] is True and "cpu" not in data
    assert data["config"]["models"] == ["tiny"] and data["config"]["repeats"] == 2
    gpu = data["environment"]["gpu"]
    assert gpu["name"] == "NVIDIA H200" and gpu["sms"] == 132 and gpu["compute_capability"] == "9.0"
    roof = data["rooflines"]
    assert roof["datasheet_tbps"] == 4.8 and roof["read_tbps"] > 0 and roof["copy16_tbps"] > 0
    assert roof["d2d_memcpy_tbps"] > 0 and "copy16_error" not in roof
    assert [(p["tokens"], p["moe"]) for p in data["points"]] == [(3, "strict"), (3, "warp-decode")]
    for point in data["points"]:
        _assert_timed_point(point, 2)
    assert [p["kernels_per_layer"] for p in data["points"]] == [7, 8]
    assert text.count("streaming reads, one graph)") == 2  # a table per point, the floor in its caption
    assert all(p["kernel_knobs"] == {"attention": {"SPLIT": 32}} for p in data["points"])
    assert data["config"]["kernel_knobs"] == [{"attention": {"SPLIT": 32}}]
    flat = " ".join(text.split())  # the tables' titles wrap
    for point in data["points"]:
        what, label = f"tiny bf16 T={point['tokens']} C=40", f"{point['moe']} [attention.SPLIT=32]"
        assert f"{what} MoE {label}: " in flat and f"{what} {label}: " in text  # table, progress
    assert "NO TIMING TAKEN" not in text and "ERROR" not in text
    report = decode.markdown(data)  # what --markdown prints for results/REPORT.md
    assert report.startswith("NVIDIA H200, streaming-read roofline") and report.count("| tiny | bf16 |") == 2
    assert report.count("| tiny [attention.SPLIT=32] | bf16 |") == 1  # warp-decode over strict, at the same knobs
    assert "| strict [attention.SPLIT=32] |" in report and "Blocks, tiny bf16 T=3 C=40 [attention.SPLIT=32]" in report


@pytest.mark.slow
def test_peers_decode_gpu_path_skips_the_peer_rows_and_says_why(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """``tools.peers.decode`` with the Triton peer's MoE and --torch: the lab's point is timed as tools.decode times
    it; without PyTorch the peer's rows are skipped with the reason, and the run still exits 0."""
    from tools.peers import decode as peers_decode
    from tools.peers import torch_step

    argv = [*ARGS, "--tokens", "1", "--moe", "strict,triton-peer", "--torch"]
    code, data, text = _run(peers_decode.main, argv, tmp_path, capsys)
    assert code == 0, text
    assert data["complete"] is True and data["config"]["torch"] is True
    lab, *peers = data["points"]
    _assert_timed_point(lab, 2)
    assert [p["moe"] for p in peers] == ["triton-peer", "torch"]
    if torch_step.WHY_NOT is None:
        pytest.skip("PyTorch is installed: the peer's rows ran (a GPU test's matter)")
    for row in peers:
        assert row["status"] == "skipped" and "PyTorch" in row["error"], row
        assert f"{row['moe']}: SKIPPED" in text


def test_capture_reports_what_broke_the_capture(emulated: EmulatedDevice) -> None:
    """A capture whose function does what a capture refuses (a copy to the host) raises that error, not the
    cudaErrorStreamCaptureInvalidated of ending it, and leaves the stream out of capture."""
    import cupy

    from tools.gpu import capture

    stream = cupy.cuda.Stream(non_blocking=True)
    values = cupy.zeros(4, dtype=cupy.int32)
    with pytest.raises(CUDARuntimeError, match="StreamCaptureUnsupported.*copy to the host"):
        capture(stream, values.get)
    assert not stream.is_capturing()
    stream.begin_capture()
    with pytest.raises(CUDARuntimeError, match="StreamCaptureUnsupported"):
        stream.synchronize()
    with pytest.raises(CUDARuntimeError, match="StreamCaptureInvalidated"):
        stream.end_capture()


def test_emulated_graph_replays_what_was_captured(emulated: EmulatedDevice) -> None:
    """A graph of a kernel launch, a fill and a device copy: nothing runs at the capture, each replay runs all three
    with the arguments' values of the capture (the kernel's launches recorded per replay); events time the
    replays (host wall-clock); a replay whose memory was freed is refused."""
    import cupy

    from kernels.decode.step import BUMP, STEP_KERNELS
    from tools.gpu import capture

    kernel = STEP_KERNELS.kernels_for(STEP_KERNELS.resolve(None, PDL=0))[BUMP]
    held = {"lengths": cupy.asarray(np.array([3, 5], np.int32))}  # the graph holds none of them
    lengths, flags, copy = held["lengths"], cupy.zeros(4, dtype=cupy.int32), cupy.zeros(2, dtype=cupy.int32)
    runtime = cupy.cuda.runtime

    def body() -> None:
        kernel((1,), (32,), (held["lengths"], np.int32(2)))
        flags.fill(7)
        runtime.memcpyAsync(copy.data.ptr, held["lengths"].data.ptr, 8, runtime.memcpyDeviceToDevice, stream.ptr)

    stream = cupy.cuda.Stream(non_blocking=True)
    graph = capture(stream, body)
    assert len(graph) == 3 and emulated.launches == []
    assert lengths.get().tolist() == [3, 5] and flags.get().tolist() == [0] * 4
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record(stream)
    for _ in range(2):
        graph.launch(stream)
    stop.record(stream)
    stop.synchronize()
    assert cupy.cuda.get_elapsed_time(start, stop) >= 0
    assert lengths.get().tolist() == [5, 7] and copy.get().tolist() == [5, 7] and flags.get().tolist() == [7] * 4
    assert [launch.kernel for launch in emulated.launches] == [BUMP, BUMP]
    with pytest.raises(CUDARuntimeError, match="InvalidResourceHandle"):
        cupy.cuda.get_elapsed_time(cupy.cuda.Event(), stop)
    del lengths, held["lengths"]
    with pytest.raises(RuntimeError, match="no live allocation"):
        graph.launch(stream)


def test_emulated_capture_refuses_what_a_gpu_refuses(emulated: EmulatedDevice) -> None:
    """No capture on the legacy stream; the device synchronized, a copy from the host, or work on the legacy stream
    while a blocking stream captures: refused, the capture invalidated. A non-blocking stream's capture lets the
    legacy stream work. Device memory past the emulated device's is refused."""
    import cupy

    values = cupy.zeros(4, dtype=cupy.int32)
    with pytest.raises(CUDARuntimeError, match="legacy stream"):
        cupy.cuda.Stream.null.begin_capture()
    for refused, error in [(cupy.cuda.runtime.deviceSynchronize, "StreamCaptureUnsupported"),
                           (lambda: values.set(np.ones(4, np.int32)), "StreamCaptureUnsupported"),
                           (lambda: values.fill(1), "StreamCaptureImplicit")]:
        blocking = cupy.cuda.Stream()
        blocking.begin_capture()
        with pytest.raises(CUDARuntimeError, match=error):
            if error == "StreamCaptureImplicit":
                refused()  # on the legacy stream, the current one
            else:
                with blocking:
                    refused()
        with pytest.raises(CUDARuntimeError, match="StreamCaptureInvalidated"):
            blocking.end_capture()
    quiet = cupy.cuda.Stream(non_blocking=True)
    quiet.begin_capture()
    values.fill(2)  # the legacy stream, not captured: runs now
    with quiet, pytest.raises(NotImplementedError, match="makes a new array"):
        values + 1
    assert len(quiet.end_capture()) == 0 and values.get().tolist() == [2] * 4
    free, total = cupy.cuda.runtime.memGetInfo()
    assert total == emulated.memory and 0 < free < total
    with pytest.raises(OutOfMemoryError):
        cupy.empty(total, dtype=cupy.uint8)


def test_step_replayed_from_a_graph_matches_the_reference(emulated: EmulatedDevice) -> None:
    """The strict step captured once (tools.gpu.capture) and replayed 3 times, each replay fed the previous one's
    argmax on the device: the reference's tokens, routing and hidden state bit for bit -- nothing in the step is
    fixed at the capture that a step must change (lengths, tokens)."""
    import cupy

    from kernels.decode.step import DeviceModel, DeviceState, build_step
    from kernels.decode_reference import make_model
    from tools.gpu import capture

    model = make_model("tiny", 4)
    state, first = prefill(model, [[1, 2, 3], [9]], mode="bf16")
    step = build_step(DeviceModel.from_model(model), DeviceState.from_state(state), 2, moe="strict")
    reference = state.copy()
    want = generate(model, reference, first.next_tokens, 3)
    step.set_tokens(first.next_tokens)
    stream = cupy.cuda.Stream(non_blocking=True)
    graph = capture(stream, step.run)
    assert len(graph) == len(step.launches) and emulated.launches == []
    for index, ref in enumerate(want):
        graph.launch(stream)
        stream.synchronize()
        got = step.read_back(hidden=True, routing=True)
        assert np.array_equal(got.next_tokens, ref.next_tokens), f"step {index}"
        assert np.array_equal(got.topk_ids, ref.topk_ids), f"step {index}: routing"
        assert np.array_equal(got.hidden.view(np.uint16), ref.hidden.view(np.uint16)), f"step {index}: hidden"
    assert step.device_state.lengths.get().tolist() == reference.lengths.tolist()
