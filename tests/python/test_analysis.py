"""analysis/flashdraft_logs.py against what the C++ side wrote.

Every value load_run returns is checked against the log read here with raw h5py
(and, for the loss, against the numbers the CLI printed while training), on a
finished log, a log read while its run is still writing it, and a log left by a
run killed with SIGKILL. The quickstart notebook is executed headless against
logs made in this session, and analysis/plot_run.py writes its PNG figures.
"""
import math
import os
import re
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

import flashdraft_logs as fl
from conftest import ANALYSIS_DIR, SOURCE_DIR

# The toy drafter has 2 attention layers and one block position.
TOY_LAYERS = 2


def raw(path, name):
    with h5py.File(path, "r", swmr=True) as f:
        return f[name][()]


def printed_losses(output: str) -> dict:
    """step (0-based) -> loss as the CLI printed it ("step     1/6  loss 3.4652 ...")."""
    return {int(m.group(1)) - 1: float(m.group(2))
            for m in re.finditer(r"^step\s+(\d+)/\d+\s+loss (\S+)", output, re.M)}


def test_finished_log_matches_the_file_and_the_cli_output(finished_toy_run):
    path, output = finished_toy_run
    run = fl.load_run(path)
    with h5py.File(path, "r") as f:
        steps = f["steps/step"][()]
        loss = f["steps/loss"][()]
        names = [s.decode() for s in f["kernels/names"][()]]
        fwd, bwd = f["kernels/forward"][()], f["kernels/backward"][()]
        acc = f["steps/position_accuracy"][()]
        mem = {p: f["memory/" + p][()] for p in ("forward", "backward", "optimizer", "step")}
        kinds = [s.decode() for s in f["events/kind"][()]]
        experiment = f.attrs["experiment"]

    # Steps: the configured 6, numbered 0..5, losses bit-identical to the file and
    # equal to what the CLI printed (4 decimals).
    assert run.n_steps == len(steps) == 6
    assert run.steps["step"].tolist() == list(range(6))
    assert run.steps["loss"].to_numpy().tobytes() == loss.tobytes()
    shown = printed_losses(output)
    assert sorted(shown) == list(range(6)), output
    for i, v in shown.items():
        assert abs(run.steps["loss"][i] - v) <= 0.5e-4 + 1e-12, (i, v)
    assert all(np.isfinite(run.steps["loss"]))
    # Per-position accuracy: acc_1 and run.positions["position 1"] (the drafter's name of the
    # column, from the log) are the file's column; the toy drafter reports the same number as
    # its "accuracy" scalar.
    assert run.position_names == ["position 1"]
    assert run.positions.shape == (6, 1)
    assert run.positions.index.tolist() == list(range(6))
    assert run.steps["acc_1"].tolist() == acc[:, 0].tolist() == run.positions["position 1"].tolist()
    assert run.steps["accuracy"].tolist() == acc[:, 0].tolist()

    # Kernels: ids map through /kernels/names; backward falls back to other/bwd
    # after 6 calls (2 layers: steps 3..5), forward stays toy_kernel/fwd.
    assert run.kernel_names == names
    assert run.selected_kernel == "toy_kernel"
    assert len(run.kernels) == fwd.size + bwd.size == 6 * TOY_LAYERS * 2
    for r in run.kernels.itertuples():
        ids = fwd if r.phase == "forward" else bwd
        assert r.variant == names[ids[r.step, r.layer]]
    expect = {(s, l, "forward"): "toy_kernel/fwd" for s in range(6) for l in range(TOY_LAYERS)}
    expect.update({(s, l, "backward"): "toy_kernel/bwd" if s < 3 else "other/bwd"
                   for s in range(6) for l in range(TOY_LAYERS)})
    got = {(r.step, r.layer, r.phase): r.variant for r in run.kernels.itertuples()}
    assert got == expect
    assert run.kernels["fallback"].tolist() == [v == "other/bwd" for v in run.kernels["variant"]]
    summary = {(r.phase, r.variant): (r.calls, r.first_step, r.last_step, r.belongs_to_selected)
               for r in run.kernel_summary.itertuples()}
    assert summary == {("forward", "toy_kernel/fwd"): (12, 0, 5, True),
                       ("backward", "toy_kernel/bwd"): (6, 0, 2, True),
                       ("backward", "other/bwd"): (6, 3, 5, False)}
    ledger = run.fallbacks[run.fallbacks["source"] == "ledger"]
    events = run.fallbacks[run.fallbacks["source"] == "event"]
    assert sorted(zip(ledger["step"], ledger["layer"])) == [(s, l) for s in (3, 4, 5) for l in range(TOY_LAYERS)]
    assert set(ledger["variant"]) == {"other/bwd"}
    assert sorted(events["step"]) == [3, 3, 4, 4, 5, 5]
    assert kinds.count("fallback") == 6

    # Memory: bytes as written, GiB = bytes / 2^30, "peak" is /memory/step.
    for col, name in (("forward", "forward"), ("backward", "backward"), ("optimizer", "optimizer"),
                      ("peak", "step")):
        assert run.memory[col].tolist() == mem[name].tolist()
        assert np.allclose(run.memory[col + "_gib"], mem[name] / 2**30, rtol=0, atol=0)
        assert (run.memory[col] > 0).all()
    assert run.memory.attrs["device"] == "cpu"

    # Events, config, meta.
    assert run.events["kind"].tolist() == kinds
    assert run.status == "finished" and run.finished
    assert run.config["run"]["steps"] == 6
    assert run.config["kernels"]["toy_kernel"]["fallback_after"] == 6
    assert run.config["attention"]["on_fallback"] == "warn"
    assert run.meta["experiment"] == experiment
    assert run.meta["experiment_path"] == str(path.parent / "finished.toml")
    assert run.meta["plugin.drafter"].startswith("toy_drafter ")
    assert run.meta["device"] == "cpu"
    assert run.eval is None
    text = run.summary()
    assert "6 steps recorded, status finished" in text and "other/bwd x6 (steps 3..5)  <- FALLBACK" in text
    run.close()


def test_log_records_the_commit_the_binary_was_built_from(finished_toy_run):
    """git_revision is taken at build time, not configure time: it names the commit the
    source tree is at (with "-dirty" when tracked files differ from it)."""
    path, _ = finished_toy_run
    with h5py.File(path, "r") as f:
        revision = f.attrs["git_revision"]
    revision = revision.decode() if isinstance(revision, bytes) else str(revision)
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=SOURCE_DIR,
                          capture_output=True, text=True)
    if head.returncode != 0:
        assert revision == "unknown"
        return
    assert re.fullmatch(r"[0-9a-f]{12}(-dirty)?", revision), revision
    assert revision.split("-")[0] == head.stdout.strip(), (revision, head.stdout)


def test_non_logs_are_refused_with_a_reason(tmp_path):
    with pytest.raises(fl.LogError, match="no such file"):
        fl.load_run(tmp_path / "missing.h5")
    with pytest.raises(fl.LogError, match="is a folder"):
        fl.load_run(tmp_path)
    text = tmp_path / "notes.h5"
    text.write_text("step,loss\n0,1.5\n")
    with pytest.raises(fl.LogError, match="not an HDF5 file"):
        fl.load_run(text)
    other = tmp_path / "other.h5"
    with h5py.File(other, "w") as f:
        f["x"] = np.arange(3)
    with pytest.raises(fl.LogError, match=r"not a flashdraft run log \(no /steps/loss\)"):
        fl.load_run(other)


def _wait_for_steps(path: Path, proc, at_least: int, timeout: float = 120):
    """Polls until load_run sees `at_least` steps; returns the Run (kept open)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the run ended early (exit {proc.returncode})"
        if path.exists():
            try:
                run = fl.load_run(path)
            except fl.LogError:
                # Created but not yet in SWMR mode (the writer holds the lock).
                time.sleep(0.05)
                continue
            if run.n_steps >= at_least:
                return run
            run.close()
        time.sleep(0.05)
    pytest.fail(f"{path}: fewer than {at_least} steps after {timeout} s")


def test_live_log_is_read_and_refreshed_while_the_run_writes_it(flashdraft, tmp_path):
    # 2 layers x 50 ms per forward call: about 0.1-0.2 s per step, 1000 steps.
    exp = flashdraft.toy_experiment(tmp_path, "live", 1000, "[kernels.toy_kernel]\nsleep_ms = 50\n")
    proc = flashdraft.start(exp, tmp_path / "out.txt")
    log = tmp_path / "live.h5"
    try:
        run = _wait_for_steps(log, proc, 2)
        assert run.status == "running or killed"
        seen, reads = run.n_steps, 0
        deadline = time.monotonic() + 120
        while seen < 10 and time.monotonic() < deadline:
            time.sleep(0.1)
            run.refresh()
            n = run.n_steps
            # Every table is cut to the fully written steps: consistent lengths,
            # steps numbered 0..n-1, never fewer than before.
            assert run.steps["step"].tolist() == list(range(n))
            assert len(run.memory) == n and len(run.positions) == n
            assert len(run.kernels) == n * TOY_LAYERS * 2
            assert set(run.kernels["variant"]) <= {"toy_kernel/fwd", "toy_kernel/bwd"}
            assert n >= seen
            assert np.isfinite(run.steps["loss"]).all() and (run.memory["peak"] > 0).all()
            seen, reads = n, reads + 1
        assert seen >= 10, (tmp_path / "out.txt").read_text()
        assert reads >= 3
        # The rows read live are the rows the file keeps.
        live_loss = run.steps["loss"].to_numpy()
        # SIGINT: the run stops before its next step and records "interrupted";
        # refresh() on the open handle sees the new rows and the event.
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130, (tmp_path / "out.txt").read_text()
        run.refresh()
        assert run.status == "interrupted"
        assert run.events["kind"].iloc[-1] == "interrupted"
        assert run.n_steps >= seen
        assert run.steps["step"].tolist() == list(range(run.n_steps))
        final = raw(log, "steps/loss")
        assert run.steps["loss"].tolist() == final.tolist()
        assert final[:seen].tolist() == live_loss.tolist()
        run.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_log_of_a_run_killed_by_sigkill_opens(flashdraft, tmp_path):
    exp = flashdraft.toy_experiment(tmp_path, "killed", 1000, "[kernels.toy_kernel]\nsleep_ms = 50\n")
    proc = flashdraft.start(exp, tmp_path / "out.txt")
    log = tmp_path / "killed.h5"
    try:
        _wait_for_steps(log, proc, 5).close()
    finally:
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    run = fl.load_run(log)
    with h5py.File(log, "r", swmr=True) as f:
        lengths = [len(f[g][k]) for g in ("steps", "memory") for k in f[g]] + \
                  [len(f["kernels/forward"]), len(f["kernels/backward"])]
        loss = f["steps/loss"][()]
        names = [s.decode() for s in f["kernels/names"][()]]
    n = min(lengths)
    assert n >= 5
    assert run.n_steps == n
    assert run.steps["step"].tolist() == list(range(n))
    assert run.steps["loss"].tolist() == loss[:n].tolist()
    assert np.isfinite(run.steps["loss"]).all()
    assert run.status == "running or killed" and not run.finished
    assert "finished" not in run.events["kind"].tolist()
    assert run.kernel_names == names == ["toy_kernel/fwd", "toy_kernel/bwd"]
    assert len(run.kernels) == n * TOY_LAYERS * 2 and not run.kernels["fallback"].any()
    run.close()


def test_compare_runs_lines_up_steps(notebook_runs):
    (a, ka), (b, kb) = notebook_runs
    ra, rb = fl.load_run(a), fl.load_run(b)
    df = fl.compare_runs([ra, rb])
    labels = list(dict.fromkeys(df.columns.get_level_values("run")))
    assert len(labels) == 2 and labels[0] != labels[1]
    assert df.index.tolist() == sorted(set(ra.steps["step"]) | set(rb.steps["step"]))
    for run, label in ((ra, labels[0]), (rb, labels[1])):
        assert df[("loss", label)].tolist() == run.steps["loss"].tolist()
        assert df[("peak_gib", label)].tolist() == (run.memory["peak"] / 2**30).tolist()
    assert {ra.selected_kernel, rb.selected_kernel} == {ka, kb}
    # Explicit labels, and paths instead of Run objects.
    df2 = fl.compare_runs([a, b], labels=["A", "B"], metrics=["loss"])
    assert list(df2.columns) == [("loss", "A"), ("loss", "B")]
    with pytest.raises(ValueError, match="2 labels for 1 runs"):
        fl.compare_runs([a], labels=["A", "B"])


def png_size(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def test_plot_run_writes_the_figures(finished_toy_run, notebook_runs, tmp_path):
    path, _ = finished_toy_run
    other = notebook_runs[1][0]
    p = subprocess.run([sys.executable, str(ANALYSIS_DIR / "plot_run.py"), str(path), str(tmp_path / "png"),
                        "--compare", str(other)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    printed = [Path(line) for line in p.stdout.split()]
    assert [x.name for x in printed] == ["loss.png", "position_accuracy.png", "tau_sim.png", "memory.png",
                                        "kernel_timeline.png", "compare.png"]
    for x in printed:
        assert x.parent == tmp_path / "png"
        w, h = png_size(x)
        assert w >= 300 and h >= 200 and x.stat().st_size > 5000, (x, w, h)
    bad = tmp_path / "bad.h5"
    bad.write_text("not a log")
    p = subprocess.run([sys.executable, str(ANALYSIS_DIR / "plot_run.py"), str(bad), str(tmp_path / "png2")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "not an HDF5 file" in p.stderr and p.stdout == ""


def test_quickstart_notebook_executes(notebook_runs, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    nb_path = ANALYSIS_DIR / "notebooks" / "quickstart.ipynb"
    nb = nbformat.read(nb_path, as_version=4)
    monkeypatch.setenv("FLASHDRAFT_RUN", str(notebook_runs[0][0]))
    monkeypatch.setenv("FLASHDRAFT_RUN_B", str(notebook_runs[1][0]))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    client = NotebookClient(nb, timeout=180, kernel_name="python3",
                            resources={"metadata": {"path": str(nb_path.parent)}})
    client.execute()  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                 if "image/png" in o.get("data", {}))
    # loss, accuracy heat map, tau_sim, memory, kernel timeline, comparison.
    assert images >= 6, f"the notebook showed {images} figures"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert str(notebook_runs[0][0]) in text  # it read the log it was pointed at


def test_partly_written_rows_eval_group_and_empty_logs(finished_toy_run, tmp_path):
    """Edits copies of a finished log with h5py the way a live writer leaves it:
    one dataset a row behind the others (cut to the shortest), an /eval group
    (read when present), and no steps at all (tables empty, plots still drawn)."""
    import shutil
    path, _ = finished_toy_run
    loss = raw(path, "steps/loss")

    lagging = tmp_path / "lagging.h5"
    shutil.copy(path, lagging)
    with h5py.File(lagging, "a") as f:
        f["memory/backward"].resize((4,))  # the writer had extended it for 4 steps only
    run = fl.load_run(lagging)
    assert run.n_steps == 4 and len(run.memory) == 4 and len(run.positions) == 4
    assert run.steps["loss"].tolist() == loss[:4].tolist()
    assert len(run.kernels) == 4 * TOY_LAYERS * 2 and run.kernels["step"].max() == 3
    run.close()

    rng = np.random.default_rng()
    ev_steps = np.array([0, 2, 4], dtype=np.int64)
    ev_loss, ev_tau = rng.uniform(1, 5, 3), rng.uniform(1, 8, 3)
    ev_acc = rng.uniform(0, 1, (3, 5))
    with_eval = tmp_path / "eval.h5"
    shutil.copy(path, with_eval)
    with h5py.File(with_eval, "a") as f:
        if "eval" in f:  # the engine's empty /eval (validation off) is replaced
            del f["eval"]
        g = f.create_group("eval")
        g["step"], g["loss"], g["tau"], g["position_accuracy"] = ev_steps, ev_loss, ev_tau, ev_acc
    run = fl.load_run(with_eval)
    assert run.eval["step"].tolist() == ev_steps.tolist()
    assert run.eval["loss"].tolist() == ev_loss.tolist()
    assert run.eval["tau_anchor"].tolist() == ev_tau.tolist()  # an old log's "tau" is the anchor figure
    assert "tau" not in run.eval
    for j in range(5):
        assert run.eval[f"acc_{j + 1}"].tolist() == ev_acc[:, j].tolist()
    assert run.eval_positions.to_numpy().tolist() == ev_acc.tolist()
    assert run.eval_positions.index.tolist() == ev_steps.tolist()
    assert "eval       3 rows" in run.summary()
    fig = fl.plot_loss(run)
    assert "eval loss" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    run.close()

    empty = tmp_path / "empty.h5"
    shutil.copy(path, empty)
    with h5py.File(empty, "a") as f:
        for g in ("steps", "memory", "kernels"):
            for name, ds in f[g].items():
                if name != "names":
                    ds.resize(0, axis=0)
    run = fl.load_run(empty)
    assert run.n_steps == 0 and len(run.memory) == 0 and len(run.kernels) == 0
    assert run.positions.shape == (0, 1)
    written = fl.plot_all(run, tmp_path / "png", compare=path)
    assert all(p.stat().st_size > 1000 for p in written)
    run.close()
