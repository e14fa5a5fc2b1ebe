"""Read flashdraft HDF5 run logs into pandas, and plot them.

A run log (written by core/src/train/trainer.cpp through core/src/log/run_log.cpp) holds:

    /                  attributes: experiment (the TOML text), experiment_path,
                       flashdraft_version, git_revision, torch_version, torch_cuda,
                       device, device_name, start_time, dtype, data_source,
                       plugins, plugin.<role>
    /steps/<name>      one row per optimizer step: step (int64), loss, lr,
                       grad_norm, step_time_s, tokens_per_s, drafter scalars
                       (e.g. tau_sim); position_accuracy is [steps, P]
    /memory/<phase>    peak bytes (int64) of forward, backward, optimizer, step
    /kernels/forward   [steps, layers] int32 variant ids (-1 = no call)
    /kernels/backward  idem; ids index /kernels/names (fixed-length strings)
    /events/{step,kind,message}
    /eval/...          (optional) validation rows: step, loss, tau_served (the acceptance
                       length a server measures; tau_served_method says how), tau_served_se,
                       tau_anchor (uniform anchors, a diagnostic that overstates it),
                       tau_data, tau_sim, ... Logs older than served validation call the
                       anchor figure tau / tau_method: they are read as tau_anchor /
                       tau_anchor_method.

The writer is in SWMR mode and extends one dataset after another, so a reader of
a live log (or of a log left by a killed run) may see per-step datasets of
different lengths: every per-step table is cut to the shortest of them, which
is the number of steps that were fully written.

    run = load_run("runs/quickstart/quickstart.h5")
    run.steps, run.positions, run.kernels, run.kernel_summary, run.fallbacks,
    run.memory, run.events, run.eval, run.config, run.meta
    run.refresh()          # re-read a log that is still being written
    compare_runs([a, b])   # loss / memory / time side by side, per step

Plots draw on matplotlib Figure objects (no pyplot, so they work headless).
"""
from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import h5py
import numpy as np
import pandas as pd

__all__ = [
    "LogError", "Run", "load_run", "compare_runs", "variant_belongs",
    "tau_comparison", "plot_loss", "plot_position_accuracy", "plot_tau_sim", "plot_memory",
    "plot_kernel_timeline", "plot_compare", "plot_all",
]

GIB = float(1 << 30)
MIB = float(1 << 20)
PHASES = ("forward", "backward", "optimizer", "step")
# Column order of run.steps: these first (when present), then drafter scalars.
_ENGINE_STEP_COLUMNS = ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "input_tokens_per_s")
# Event kinds after which the writer stopped.
_TERMINAL_KINDS = ("finished", "interrupted", "error", "fallback_error", "nan", "oom")


class LogError(ValueError):
    """The file is missing, not HDF5, or not a flashdraft run log."""


def variant_belongs(variant: str | None, kernel: str | None) -> bool:
    """A variant belongs to kernel K if it is K or starts with "K/" (e.g. flash_cpu/fwd/fp32/q64k64)."""
    if variant is None or not kernel:
        return False
    return variant == kernel or variant.startswith(kernel + "/")


def _text(value) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\0")
    if isinstance(value, np.ndarray) and value.shape == ():
        return _text(value[()])
    return str(value)


def _variant_names(names: list, ids: np.ndarray) -> np.ndarray:
    """ids -> names (object array); an id past the names read so far (a live log
    whose name row was not visible yet) becomes "<variant id N>"."""
    table = np.array(list(names) + [None], dtype=object)
    out = table[np.minimum(ids, len(names))]
    for i in np.unique(ids[ids >= len(names)]):
        out[ids == i] = f"<variant id {i}>"
    return out


def _open(path: Path) -> h5py.File:
    """Opens read-only: SWMR first (live logs, and logs of killed SWMR writers,
    whose superblock still says "open for writing"), then plain."""
    if not path.exists():
        raise LogError(f"{path}: no such file (expected a flashdraft run log, e.g. runs/<name>/<name>.h5)")
    if path.is_dir():
        raise LogError(f"{path}: is a folder, not a run log file")
    if not h5py.is_hdf5(path):
        raise LogError(f"{path}: not an HDF5 file, so not a flashdraft run log")
    errors = []
    for kwargs in ({"swmr": True}, {"swmr": True, "locking": False}, {}, {"locking": False}):
        try:
            return h5py.File(path, "r", **kwargs)
        except (OSError, ValueError) as e:  # lock held, consistency flags, ...
            errors.append(f"{kwargs or 'plain'}: {e}")
    raise LogError(f"{path}: cannot open the HDF5 file read-only (" + "; ".join(errors) +
                   "). If the run is just starting, retry in a moment.")


def _read(ds: h5py.Dataset, swmr: bool) -> np.ndarray:
    if swmr:
        ds.refresh()
    return ds[()]


@dataclass
class Run:
    """One run log. Tables are pandas DataFrames; see the module docstring."""

    path: Path
    meta: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    config_error: str | None = None
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)
    positions: pd.DataFrame = field(default_factory=pd.DataFrame)
    memory: pd.DataFrame = field(default_factory=pd.DataFrame)
    kernels: pd.DataFrame = field(default_factory=pd.DataFrame)
    kernel_names: list = field(default_factory=list)
    kernel_summary: pd.DataFrame = field(default_factory=pd.DataFrame)
    fallbacks: pd.DataFrame = field(default_factory=pd.DataFrame)
    events: pd.DataFrame = field(default_factory=pd.DataFrame)
    eval: pd.DataFrame | None = None
    eval_positions: pd.DataFrame | None = None
    kernel_attrs: dict = field(default_factory=dict)
    memory_attrs: dict = field(default_factory=dict)
    position_names: list = field(default_factory=list)  # the per-position columns' names
    layers: int = 0
    _file: h5py.File | None = field(default=None, repr=False)

    # --- reading ------------------------------------------------------------------
    def refresh(self) -> "Run":
        """Re-reads every table (for a log that is still being written). Returns self."""
        if self._file is None or not self._file.id.valid:
            self._file = _open(self.path)
        elif not self._file.swmr_mode:
            # A plain handle does not see new rows: open again.
            self._file.close()
            self._file = _open(self.path)
        self._load(self._file)
        return self

    def close(self) -> None:
        if self._file is not None and self._file.id.valid:
            self._file.close()
        self._file = None

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _load(self, f: h5py.File) -> None:
        swmr = bool(f.swmr_mode)
        if "steps" not in f or "loss" not in f["steps"]:
            raise LogError(f"{self.path}: an HDF5 file, but not a flashdraft run log (no /steps/loss)"
                           if "experiment" not in f.attrs else
                           f"{self.path}: the run log has no /steps yet (the run is starting); retry in a moment")
        self.meta = {k: _text(v) for k, v in f.attrs.items()}
        try:
            self.config = tomllib.loads(self.meta.get("experiment", ""))
            self.config_error = None
        except tomllib.TOMLDecodeError as e:
            self.config, self.config_error = {}, f"the experiment text in the log does not parse as TOML: {e}"

        # Per-step datasets; all are cut to the shortest (fully written steps).
        raw: dict[str, np.ndarray] = {}
        for group in ("steps", "memory"):
            if group in f:
                for name, ds in f[group].items():
                    if isinstance(ds, h5py.Dataset):
                        raw[f"{group}/{name}"] = _read(ds, swmr)
        for phase in ("forward", "backward"):
            if f"kernels/{phase}" in f:
                raw[f"kernels/{phase}"] = _read(f[f"kernels/{phase}"], swmr)
        n = min(len(a) for a in raw.values())
        raw = {k: v[:n] for k, v in raw.items()}
        # Names are appended before the ids that use them: reading them last
        # means every id read above has its name (unless metadata lagged).
        self.kernel_names = [_text(s) for s in _read(f["kernels/names"], swmr)] if "kernels/names" in f else []
        self.kernel_attrs = {k: _text(v) for k, v in f["kernels"].attrs.items()} if "kernels" in f else {}
        self.memory_attrs = {k: _text(v) for k, v in f["memory"].attrs.items()} if "memory" in f else {}
        # The per-position metric's columns by name (logs before 2026-12-04 have none: 1..P).
        names = _text(f["steps"].attrs.get("position_names", "")) if "steps" in f else ""
        self.position_names = names.split("\n") if names else []

        step = raw["steps/step"].astype(np.int64) if "steps/step" in raw else np.arange(n, dtype=np.int64)
        self._load_steps(raw, step)
        self._load_memory(raw, step)
        self._load_events(f, swmr)
        self._load_kernels(raw, step)
        self._load_eval(f, swmr)

    def _load_steps(self, raw: dict, step: np.ndarray) -> None:
        cols: dict[str, np.ndarray] = {"step": step}
        scalars = sorted(k.split("/", 1)[1] for k in raw if k.startswith("steps/") and raw[k].ndim == 1)
        ordered = [c for c in _ENGINE_STEP_COLUMNS if c in scalars] + \
                  [c for c in scalars if c not in _ENGINE_STEP_COLUMNS]
        for c in ordered:
            if c != "step":
                cols[c] = raw["steps/" + c].astype(np.float64)
        acc = raw.get("steps/position_accuracy")
        if acc is None or acc.ndim != 2:
            acc = np.zeros((len(step), 0))
        self.positions = pd.DataFrame(acc, index=pd.Index(step, name="step"),
                                      columns=self._position_index(acc.shape[1]))
        for j in range(acc.shape[1]):
            cols[f"acc_{j + 1}"] = acc[:, j]
        self.steps = pd.DataFrame(cols)

    def _position_index(self, width: int) -> pd.Index:
        """The per-position columns: the drafter's names where the log has them, else 1..P."""
        if len(self.position_names) == width:
            return pd.Index(self.position_names, name="position")
        return pd.Index(range(1, width + 1), name="position")

    def _load_memory(self, raw: dict, step: np.ndarray) -> None:
        # Column "peak" is /memory/step (the whole step's peak): "step" is the step number.
        cols: dict[str, np.ndarray] = {"step": step}
        for ph in PHASES:
            if f"memory/{ph}" in raw:
                cols["peak" if ph == "step" else ph] = raw[f"memory/{ph}"].astype(np.int64)
        df = pd.DataFrame(cols)
        for c in list(df.columns[1:]):
            df[c + "_gib"] = df[c] / GIB
        df.attrs.update(self.memory_attrs)
        self.memory = df

    def _load_events(self, f: h5py.File, swmr: bool) -> None:
        if "events" in f and all(k in f["events"] for k in ("step", "kind", "message")):
            s, k, m = (_read(f["events/" + x], swmr) for x in ("step", "kind", "message"))
            n = min(len(s), len(k), len(m))
            self.events = pd.DataFrame({"step": s[:n].astype(np.int64),
                                        "kind": [_text(x) for x in k[:n]],
                                        "message": [_text(x) for x in m[:n]]})
        else:
            self.events = pd.DataFrame({"step": pd.Series([], dtype=np.int64),
                                        "kind": pd.Series([], dtype=object),
                                        "message": pd.Series([], dtype=object)})

    def _load_kernels(self, raw: dict, step: np.ndarray) -> None:
        selected = self.kernel_attrs.get("selected")
        names = self.kernel_names
        frames = []
        self.layers = 0
        for phase in ("forward", "backward"):
            ids = raw.get(f"kernels/{phase}")
            if ids is None or ids.ndim != 2:
                continue
            self.layers = max(self.layers, ids.shape[1])
            s_idx, l_idx = np.nonzero(ids >= 0)  # -1: the layer made no call of this phase
            vid = ids[s_idx, l_idx].astype(np.int64)
            frames.append(pd.DataFrame({
                "step": step[s_idx], "layer": l_idx.astype(np.int64), "phase": phase, "variant_id": vid,
                "variant": _variant_names(names, vid)}))
        cols = {"step": np.int64, "layer": np.int64, "phase": object, "variant_id": np.int64, "variant": object}
        k = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(
            {c: pd.Series([], dtype=t) for c, t in cols.items()})
        # The kernel each column's calls were chosen to run (logs since 2026-12-08: the drafter's calls, the target's,
        # the LM-head loss; they differ where the choice ran some calls on a fallback); else the one selected.
        expected = [line for line in str(self.kernel_attrs.get("column_kernels", "")).split("\n") if line]
        k["expected"] = [expected[l] if l < len(expected) else selected for l in k["layer"]]
        k["fallback"] = ~np.array([variant_belongs(v, e) for v, e in zip(k["variant"], k["expected"])], dtype=bool)
        k = k.sort_values(["step", "phase", "layer"], kind="stable", ignore_index=True)
        k.attrs.update(self.kernel_attrs)
        self.kernels = k

        if len(k):
            g = k.groupby(["phase", "variant"], sort=False)
            summary = g.agg(calls=("step", "size"), first_step=("step", "min"), last_step=("step", "max"),
                            layers=("layer", lambda x: sorted(set(int(i) for i in x)))).reset_index()
            own = k.groupby(["phase", "variant"], sort=False)["fallback"].any()
            summary["belongs_to_selected"] = [not own[(p, v)] for p, v in zip(summary["phase"], summary["variant"])]
            summary = summary.sort_values(["phase", "first_step"], key=lambda c: c.map({"forward": 0, "backward": 1})
                                          if c.name == "phase" else c, ignore_index=True)
        else:
            summary = pd.DataFrame(columns=["phase", "variant", "calls", "first_step", "last_step", "layers",
                                            "belongs_to_selected"])
        self.kernel_summary = summary

        # Fallbacks: the engine's fallback events and every ledger entry that ran a
        # variant not belonging to the selected kernel (a warn-policy fallback).
        ev = self.events[self.events["kind"].isin(["fallback", "fallback_error"])]
        rows = [{"step": int(r.step), "source": "event", "kind": r.kind, "layer": pd.NA, "phase": None,
                 "variant": None, "message": r.message} for r in ev.itertuples()]
        for r in k[k["fallback"]].itertuples():
            rows.append({"step": int(r.step), "source": "ledger", "kind": "foreign_variant", "layer": int(r.layer),
                         "phase": r.phase, "variant": r.variant,
                         "message": f"{r.phase} of layer {r.layer} ran '{r.variant}', "
                                    f"not a variant of the selected kernel '{r.expected}'"})
        self.fallbacks = pd.DataFrame(rows, columns=["step", "source", "kind", "layer", "phase", "variant", "message"])

    def _load_eval(self, f: h5py.File, swmr: bool) -> None:
        self.eval = self.eval_positions = None
        if "eval" not in f:
            return
        raw = {name: _read(ds, swmr) for name, ds in f["eval"].items() if isinstance(ds, h5py.Dataset)}
        if not raw:
            return
        n = min(len(a) for a in raw.values())
        if n == 0:  # the engine declares /eval in every log; no validation ran
            return
        step = raw["step"][:n].astype(np.int64) if "step" in raw else np.arange(n, dtype=np.int64)
        cols: dict[str, np.ndarray] = {"step": step}
        for name in sorted(raw):
            a = raw[name][:n]
            if name == "step":
                continue
            if a.ndim == 1 and a.dtype.kind in "SOU":  # text, e.g. tau_method
                cols[name] = np.array([_text(x) for x in a], dtype=object)
            elif a.ndim == 1:
                cols[name] = a.astype(np.float64)
            elif a.ndim == 2:
                prefix = "acc" if name == "position_accuracy" else name
                for j in range(a.shape[1]):
                    cols[f"{prefix}_{j + 1}"] = a[:, j].astype(np.float64)
                if name == "position_accuracy":
                    self.eval_positions = pd.DataFrame(
                        a.astype(np.float64), index=pd.Index(step, name="step"),
                        columns=self._position_index(a.shape[1]))
        # Logs written before served validation: the anchor figure was "tau".
        for old, new in (("tau", "tau_anchor"), ("tau_method", "tau_anchor_method")):
            if old in cols and new not in cols:
                cols[new] = cols.pop(old)
        self.eval = pd.DataFrame(cols)

    # --- conveniences -------------------------------------------------------------
    @property
    def name(self) -> str:
        return str(self.config.get("run", {}).get("name") or self.path.stem)

    @property
    def selected_kernel(self) -> str | None:
        return self.kernel_attrs.get("selected")

    @property
    def n_steps(self) -> int:
        return len(self.steps)

    @property
    def status(self) -> str:
        """The last terminal event's kind (finished, interrupted, error, ...), or
        "running or killed" when the writer has not recorded an end."""
        ends = self.events[self.events["kind"].isin(_TERMINAL_KINDS)]
        return str(ends["kind"].iloc[-1]) if len(ends) else "running or killed"

    @property
    def finished(self) -> bool:
        return self.status == "finished"

    def summary(self) -> str:
        """A few lines of text, like `flashdraft inspect`."""
        m = self.meta
        lines = [f"run log    {self.path}",
                 f"run        {self.name}: {self.n_steps} steps recorded, status {self.status}",
                 f"started    {m.get('start_time', '?')} on {m.get('device', '?')} ({m.get('device_name', '?')}), "
                 f"dtype {m.get('dtype', '?')}",
                 f"software   flashdraft {m.get('flashdraft_version', '?')} ({m.get('git_revision', '?')}), "
                 f"LibTorch {m.get('torch_version', '?')}",
                 f"data       {m.get('data_source', '?')}"]
        if self.n_steps:
            loss = self.steps["loss"]
            lines.append(f"loss       first {loss.iloc[0]:.4f}  last {loss.iloc[-1]:.4f}  min {loss.min():.4f}")
            if "tau_sim" in self.steps:
                lines.append(f"tau_sim    first {self.steps['tau_sim'].iloc[0]:.3f}  last {self.steps['tau_sim'].iloc[-1]:.3f}")
            peaks = ", ".join(f"{c} {self.memory[c].max() / MIB:.2f} MiB"
                              for c in ("forward", "backward", "optimizer", "peak") if c in self.memory)
            lines.append(f"memory     {peaks}")
        lines.append(f"kernel     {self.selected_kernel} for {self.kernel_attrs.get('problem', '?')}")
        for r in self.kernel_summary.itertuples():
            mark = "" if r.belongs_to_selected else "  <- FALLBACK"
            lines.append(f"  {r.phase:<8} {r.variant} x{r.calls} (steps {r.first_step}..{r.last_step}){mark}")
        if len(self.fallbacks):
            lines.append(f"fallbacks  {len(self.fallbacks)} "
                         f"({(self.fallbacks['source'] == 'event').sum()} events)")
        if self.eval is not None:
            lines.append(f"eval       {len(self.eval)} rows")
            line = tau_comparison(self)
            if line:
                lines.append(f"  {line}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, name={self.name!r}, steps={self.n_steps}, status={self.status!r})"


def load_run(path: str | os.PathLike | Run) -> Run:
    """Opens a run log (finished, live or left by a killed run) and reads it.

    The file stays open (read-only, SWMR when possible) so that run.refresh()
    sees new steps; run.close() or `with load_run(p) as run:` releases it."""
    if isinstance(path, Run):
        return path
    run = Run(path=Path(path))
    run._file = _open(run.path)
    try:
        run._load(run._file)
    except LogError:
        run.close()
        raise
    except (KeyError, OSError, ValueError) as e:
        run.close()
        raise LogError(f"{run.path}: cannot read as a flashdraft run log ({e})") from e
    return run


def _labels(runs: Sequence[Run], labels: Sequence[str] | None) -> list[str]:
    if labels is not None:
        if len(labels) != len(runs):
            raise ValueError(f"compare_runs: {len(labels)} labels for {len(runs)} runs")
        return list(labels)
    out = [r.name for r in runs]
    if len(set(out)) < len(out):
        out = [f"{r.name} [{r.selected_kernel}]" for r in runs]
    if len(set(out)) < len(out):
        out = [f"{o} #{i}" for i, o in enumerate(out)]
    return out


def compare_runs(runs: Iterable, labels: Sequence[str] | None = None,
                 metrics: Sequence[str] = ("loss", "peak_gib", "step_time_s", "tau_sim")) -> pd.DataFrame:
    """Lines up runs per step: a frame indexed by step, columns (metric, run label).

    Metrics are columns of run.steps or run.memory (e.g. loss, tau_sim, acc_1,
    forward_gib, peak_gib); a metric a run does not have is left out for it.
    Steps missing from a run (shorter or killed) are NaN."""
    runs = [load_run(r) for r in runs]
    if not runs:
        raise ValueError("compare_runs: no runs given")
    labels = _labels(runs, labels)
    parts = {}
    for metric in metrics:
        for run, label in zip(runs, labels):
            for table in (run.steps, run.memory):
                if metric in table.columns and metric != "step":
                    parts[(metric, label)] = table.set_index("step")[metric]
                    break
    if not parts:
        raise ValueError(f"compare_runs: none of the runs has any of {list(metrics)}")
    df = pd.concat(parts, axis=1)
    df.columns = pd.MultiIndex.from_tuples(df.columns, names=["metric", "run"])
    df.index.name = "step"
    return df


# --- plots -------------------------------------------------------------------------
def _axes(ax, figsize=(7, 4)):
    if ax is not None:
        return ax.figure, ax
    from matplotlib.figure import Figure
    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.add_subplot()


def _empty(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _ema(y: np.ndarray, alpha: float) -> np.ndarray:
    out = np.empty_like(y, dtype=float)
    acc = math.nan
    for i, v in enumerate(y):
        acc = v if math.isnan(acc) else alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def plot_loss(run, ax=None):
    """Training loss per step (with a moving average, eval loss if logged, lr on a second axis)."""
    run = load_run(run)
    fig, ax = _axes(ax)
    s = run.steps
    if not len(s):
        _empty(ax, "no steps recorded yet")
        return fig
    ax.plot(s["step"], s["loss"], lw=1, alpha=0.5 if len(s) > 20 else 1.0, color="C0", label="train loss",
            marker="o" if len(s) <= 20 else None, ms=3)
    if len(s) > 20:
        ax.plot(s["step"], _ema(s["loss"].to_numpy(), 2.0 / (1 + max(5, len(s) // 20))), color="C0", lw=2,
                label="moving average")
    if run.eval is not None and "loss" in run.eval:
        ax.plot(run.eval["step"], run.eval["loss"], "s-", color="C3", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if "lr" in s:
        ax2 = ax.twinx()
        ax2.plot(s["step"], s["lr"], color="0.5", ls="--", lw=1, label="lr")
        ax2.set_ylabel("learning rate", color="0.4")
        ax2.tick_params(axis="y", colors="0.4")
        h1, l1 = ax.get_legend_handles_labels()
        h2, l2 = ax2.get_legend_handles_labels()
        ax.legend(h1 + h2, l1 + l2, loc="best", fontsize=8)
    else:
        ax.legend(fontsize=8)
    ax.set_title(f"{run.name}: loss ({run.n_steps} steps, {run.status})")
    return fig


def plot_position_accuracy(run, ax=None):
    """Heat map of the accuracy per block position (rows) over steps (columns)."""
    run = load_run(run)
    fig, ax = _axes(ax, (8, 4))
    p = run.positions
    if p.shape[0] == 0 or p.shape[1] == 0:
        _empty(ax, "no per-position accuracy recorded")
        return fig
    steps = p.index.to_numpy()
    data = p.to_numpy().T  # [positions, steps]
    x0, x1 = (steps[0] - 0.5, steps[-1] + 0.5)
    # Colour scale 0..1 once a position reaches 0.5; early runs get 0..(max
    # rounded up to 0.1) so that small accuracies stay visible.
    top = float(np.nanmax(data)) if np.isfinite(data).any() else 1.0
    vmax = 1.0 if top >= 0.5 else max(0.1, math.ceil(top * 10) / 10)
    im = ax.imshow(np.ma.masked_invalid(data), aspect="auto", origin="lower", cmap="viridis", vmin=0.0, vmax=vmax,
                   interpolation="nearest", extent=(x0, x1, 0.5, data.shape[0] + 0.5))
    ax.set_xlabel("step")
    named = all(isinstance(c, str) for c in p.columns)
    ax.set_ylabel("the drafter's positions" if named else "block position (1 = right after the anchor)")
    if data.shape[0] <= 20:
        ax.set_yticks(range(1, data.shape[0] + 1))
        if named:
            ax.set_yticklabels(list(p.columns), fontsize=7)
    fig.colorbar(im, ax=ax, label="accuracy")
    ax.set_title(f"{run.name}: accuracy per " + ("position" if named else "block position"))
    return fig


def tau_comparison(run) -> str:
    """The last validation's acceptance lengths side by side, one line each:
    tau_served (what a server measures: held-out responses decoded block after block; by
    the online target, or on the data's tokens), tau_anchor (the same acceptance at uniformly
    drawn anchors, by target verification when it can; it overstates tau_served when
    acceptance is uneven) with tau_data, and tau_sim. "" when the log has no such columns."""
    run = load_run(run)
    e = run.eval
    if e is None or not len(e):
        return ""
    lines = []
    served = float("nan")
    if "tau_served" in e and "tau_served_method" in e:
        served = float(e["tau_served"].iloc[-1])
        se = float(e["tau_served_se"].iloc[-1]) if "tau_served_se" in e else float("nan")
        method = e["tau_served_method"].iloc[-1]
        line = f"tau_served {served:.4f}" + (f" +- {se:.4f}" if se == se else "") + f": {method}"
        if str(method).startswith("target") and "tau_served_data" in e:
            data = float(e["tau_served_data"].iloc[-1])
            if data == data:
                line += f"; on the data's tokens {data:.4f}" + (
                    " (equal: the data is the target's greedy text)" if data == served else "")
        lines.append(line)
    if "tau_anchor_method" in e and "tau_data" in e and "tau_anchor" in e:
        method, tau, data = e["tau_anchor_method"].iloc[-1], e["tau_anchor"].iloc[-1], e["tau_data"].iloc[-1]
        line = f"tau_anchor {tau:.4f} ({method})"
        if method == "target verification":
            line += ("; tau_data equals it (the data is the target's own greedy output)" if tau == data else
                     f"; tau_data {data:.4f} differs by {data - tau:+.4f} (the data is not the target's greedy output)")
        lines.append(line)
        if served == served and served > 0:
            rel = f"against it tau_anchor is {100 * (tau / served - 1):+.1f}%"
            if "tau_sim" in e:
                rel += f", tau_sim {100 * (e['tau_sim'].iloc[-1] / served - 1):+.1f}%"
            lines.append("which tau to trust: tau_served (what a server measures); " + rel)
    return "\n".join(lines)


def plot_tau_sim(run, ax=None):
    """tau_sim (simulated acceptance length) per step, with eval tau / tau_sim when logged."""
    run = load_run(run)
    fig, ax = _axes(ax)
    s = run.steps
    if "tau_sim" not in s:
        other = [c for c in s.columns if c not in _ENGINE_STEP_COLUMNS and not c.startswith("acc_")]
        _empty(ax, "no tau_sim in this log" + (f"\n(drafter metrics: {', '.join(other)})" if other else ""))
        ax.set_title(f"{run.name}: tau_sim")
        return fig
    ax.plot(s["step"], s["tau_sim"], lw=1, alpha=0.5 if len(s) > 20 else 1.0, color="C2", label="train tau_sim",
            marker="o" if len(s) <= 20 else None, ms=3)
    if len(s) > 20:
        ax.plot(s["step"], _ema(s["tau_sim"].to_numpy(), 2.0 / (1 + max(5, len(s) // 20))), color="C2", lw=2,
                label="moving average")
    if run.eval is not None:
        for c, m, lw in (("tau_served", "o-", 2.5), ("tau_anchor", "^--", 1), ("tau_sim", "s:", 1)):
            if c in run.eval and run.eval[c].notna().any():
                ax.plot(run.eval["step"], run.eval[c], m, lw=lw,
                        label=f"eval {c}" + (" (what a server measures)" if c == "tau_served" else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("tau_sim (tokens accepted per block)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{run.name}: tau_sim")
    return fig


def _mem_unit(max_bytes: float):
    return (GIB, "GiB") if max_bytes >= GIB else (MIB, "MiB")


def plot_memory(run, ax=None):
    """Peak memory per phase (forward, backward, optimizer) and per step, over steps."""
    run = load_run(run)
    fig, ax = _axes(ax)
    m = run.memory
    cols = [c for c in ("forward", "backward", "optimizer", "peak") if c in m]
    if not len(m) or not cols:
        _empty(ax, "no memory recorded yet")
        return fig
    scale, unit = _mem_unit(float(m[cols].to_numpy().max()))
    for c, style in zip(cols, ("-", "-", "-", "--")):
        ax.plot(m["step"], m[c] / scale, style, label="whole step" if c == "peak" else c,
                color="k" if c == "peak" else None, lw=1.5, marker="o" if len(m) <= 20 else None, ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel(f"peak {unit}")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    dev = run.memory_attrs.get("device", run.meta.get("device", "?"))
    ax.set_title(f"{run.name}: peak memory per phase ({dev})")
    method = run.memory_attrs.get("method")
    if method:
        ax.text(0.01, 0.01, method, transform=ax.transAxes, fontsize=7, color="0.4")
    return fig


def plot_kernel_timeline(run, fig=None):
    """Which kernel variant ran per layer (rows) and step (columns), forward and
    backward; variants not belonging to the selected kernel (fallbacks) in red."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    run = load_run(run)
    if fig is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(9, 2.2 + 0.35 * max(run.layers, 1) * 2), layout="constrained")
    axes = fig.subplots(2, 1, sharex=True, squeeze=True)
    k = run.kernels
    selected = run.selected_kernel
    steps = run.steps["step"].to_numpy()
    if not len(steps) or not len(k):
        _empty(axes[0], "no kernel calls recorded yet")
        _empty(axes[1], "")
        return fig
    # Colours: own variants get blues/greens, foreign variants reds.
    in_order = list(dict.fromkeys(pd.concat([k.loc[k["phase"] == p, "variant"] for p in ("forward", "backward")])))
    own = [v for v in in_order if variant_belongs(v, selected)]
    foreign = [v for v in in_order if not variant_belongs(v, selected)]
    names = own + foreign
    own_colours = ["#4c72b0", "#55a868", "#8172b2", "#64b5cd", "#937860", "#8c8c8c", "#ccb974", "#da8bc3"]
    red_colours = ["#d62728", "#ff7f0e", "#8b0000", "#ff9896"]
    colour = {v: own_colours[i % len(own_colours)] for i, v in enumerate(own)}
    colour.update({v: red_colours[i % len(red_colours)] for i, v in enumerate(foreign)})
    code = {v: i for i, v in enumerate(names)}
    cmap = ListedColormap([colour[v] for v in names])
    cmap.set_bad("white")  # no call
    step_pos = {int(s): i for i, s in enumerate(steps)}
    # Fallback events during training (step >= 0) are drawn as dotted red lines;
    # a fallback at kernel selection (step -1) goes into the title.
    ev_steps = sorted(set(int(s) for s in run.fallbacks.loc[run.fallbacks["source"] == "event", "step"]
                          if steps[0] <= int(s) <= steps[-1]))
    for ax, phase in zip(axes, ("forward", "backward")):
        grid = np.full((max(run.layers, 1), len(steps)), np.nan)
        kp = k[(k["phase"] == phase) & k["step"].isin(step_pos)]
        cols = kp["step"].map(step_pos).to_numpy(dtype=np.int64)
        grid[kp["layer"].to_numpy(dtype=np.int64), cols] = kp["variant"].map(code).to_numpy(dtype=float)
        ax.imshow(np.ma.masked_invalid(grid), aspect="auto", origin="lower", cmap=cmap, vmin=-0.5,
                  vmax=len(names) - 0.5, interpolation="nearest",
                  extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, grid.shape[0] - 0.5))
        ax.set_ylabel(f"{phase}\nlayer")
        ax.set_yticks(range(grid.shape[0]))
        for s in ev_steps:
            ax.axvline(s, color="red", lw=1.2, ls=":")
    axes[-1].set_xlabel("step")
    handles = [Patch(color=colour[v], label=v + ("" if v in own else "  (FALLBACK)")) for v in names]
    handles.append(Patch(facecolor="white", edgecolor="0.6", label="no call"))
    if ev_steps:
        from matplotlib.lines import Line2D
        handles.append(Line2D([], [], color="red", ls=":", label="fallback event"))
    fig.legend(handles=handles, loc="outside right upper", fontsize=8, frameon=False)
    title = f"{run.name}: kernel variants per layer (selected: {selected})"
    if (run.fallbacks["step"] < 0).any():
        import textwrap
        msg = str(run.fallbacks.loc[run.fallbacks["step"] < 0, "message"].iloc[0])
        title += "\n" + "\n".join(textwrap.wrap("selection FELL BACK before step 0: " + msg, 80)[:3])
    n_bad = int(k["fallback"].sum())
    if n_bad:
        title += f"\n{n_bad} of {len(k)} calls ran a variant of another kernel (red)"
    fig.suptitle(title, fontsize=10, color="red" if n_bad or (run.fallbacks["step"] < 0).any() else "black")
    return fig


def plot_compare(runs, labels: Sequence[str] | None = None, fig=None):
    """Two or more runs side by side: loss per step, whole-step peak memory per
    step, and the largest peak per phase as bars."""
    runs = [load_run(r) for r in runs]
    labels = _labels(runs, labels)
    if fig is None:
        from matplotlib.figure import Figure
        fig = Figure(figsize=(14, 4), layout="constrained")
    ax_loss, ax_mem, ax_bar = fig.subplots(1, 3)
    for i, (run, label) in enumerate(zip(runs, labels)):
        s = run.steps
        ax_loss.plot(s["step"], s["loss"], color=f"C{i}", lw=1.5, ls=("-", "--", ":", "-.")[i % 4], label=label)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("training loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend(fontsize=8)

    maxb = max([float(r.memory[[c for c in ("forward", "backward", "optimizer", "peak") if c in r.memory]]
                      .to_numpy().max()) for r in runs if len(r.memory)] or [0.0])
    scale, unit = _mem_unit(maxb)
    for i, (run, label) in enumerate(zip(runs, labels)):
        if "peak" in run.memory:
            ax_mem.plot(run.memory["step"], run.memory["peak"] / scale, color=f"C{i}", lw=1.5, label=label)
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel(f"peak {unit} (whole step)")
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_title("peak memory per step")
    ax_mem.grid(alpha=0.3)
    ax_mem.legend(fontsize=8)

    phases = ["forward", "backward", "optimizer"]
    width = 0.8 / max(len(runs), 1)
    for i, (run, label) in enumerate(zip(runs, labels)):
        vals = [run.memory[p].max() / scale if p in run.memory and len(run.memory) else 0.0 for p in phases]
        bars = ax_bar.bar(np.arange(len(phases)) + (i - (len(runs) - 1) / 2) * width, vals, width, label=label,
                          color=f"C{i}")
        ax_bar.bar_label(bars, fmt="%.2f", fontsize=7)
    ax_bar.set_xticks(range(len(phases)), phases)
    ax_bar.set_ylabel(f"max peak {unit}")
    ax_bar.set_title("largest peak per phase")
    ax_bar.legend(fontsize=8)
    ax_bar.set_ylim(top=ax_bar.get_ylim()[1] * 1.2)  # room for the legend above the bars
    fig.suptitle("  vs  ".join(l if str(r.selected_kernel) in l else f"{l} ({r.selected_kernel})"
                               for r, l in zip(runs, labels)), fontsize=10)
    return fig


def plot_all(run, outdir, compare=None, dpi: int = 110) -> list[Path]:
    """Writes every figure of `run` as PNG into `outdir` (and the comparison with
    `compare`, a run or path, when given). Returns the paths written."""
    run = load_run(run)
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    figures = [("loss.png", plot_loss(run)), ("position_accuracy.png", plot_position_accuracy(run)),
               ("tau_sim.png", plot_tau_sim(run)), ("memory.png", plot_memory(run)),
               ("kernel_timeline.png", plot_kernel_timeline(run))]
    if compare is not None:
        figures.append(("compare.png", plot_compare([run, load_run(compare)])))
    written = []
    for name, fig in figures:
        path = out / name
        fig.savefig(path, dpi=dpi)
        written.append(path)
    return written
