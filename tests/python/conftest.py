"""Shared fixtures of the Python tests: where the CLI and plugins are, and short
training runs producing fresh run logs.

ctest sets FLASHDRAFT_CLI, FLASHDRAFT_SOURCE_DIR and FLASHDRAFT_BINARY_DIR; run by
hand (`.venv/bin/python -m pytest tests/python`) the defaults are the repository
this file is in and its build/ folder.
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

SOURCE_DIR = Path(os.environ.get("FLASHDRAFT_SOURCE_DIR") or Path(__file__).resolve().parents[2])
BINARY_DIR = Path(os.environ.get("FLASHDRAFT_BINARY_DIR") or SOURCE_DIR / "build")
CLI = Path(os.environ.get("FLASHDRAFT_CLI") or BINARY_DIR / "bin" / "flashdraft")
TEST_PLUGIN_DIR = BINARY_DIR / "test-plugins"
ANALYSIS_DIR = SOURCE_DIR / "analysis"
QUICKSTART = SOURCE_DIR / "experiments" / "quickstart.toml"

if str(ANALYSIS_DIR) not in sys.path:
    sys.path.insert(0, str(ANALYSIS_DIR))


class Flashdraft:
    """Runs the flashdraft CLI on experiment files written into temp folders."""

    cli = CLI
    test_plugin_dir = TEST_PLUGIN_DIR

    def check(self):
        if not (CLI.is_file() and os.access(CLI, os.X_OK)):
            pytest.fail(f"the flashdraft CLI was not found at {CLI}; build it or set FLASHDRAFT_CLI")
        if not TEST_PLUGIN_DIR.is_dir():
            pytest.fail(f"the toy test plugins were not found in {TEST_PLUGIN_DIR}; build them or set "
                        "FLASHDRAFT_BINARY_DIR")

    @staticmethod
    def toy_experiment(folder: Path, name: str, steps: int, extra: str = "",
                       kernels=("toy_kernel",)) -> Path:
        """An experiment of the toy test plugins (tests/plugins): 2 attention layers, 1 position."""
        kernel_list = ", ".join(f'"{k}"' for k in kernels)
        text = (f'[run]\nname = "{name}"\nsteps = {steps}\nout = "{folder}"\nprint_every = 1\n'
                '[drafter]\nplugin = "toy_drafter"\n[dataset]\nplugin = "toy_data"\n[mask]\nplugin = "causal"\n'
                f"[attention]\nkernels = [{kernel_list}]\n" + extra)
        path = folder / f"{name}.toml"
        path.write_text(text)
        return path

    def args(self, experiment: Path, *extra: str):
        return [str(CLI), "run", str(experiment), "--plugin-path", str(TEST_PLUGIN_DIR), *extra]

    def run(self, experiment: Path, *extra: str, timeout: float = 300):
        """Runs to the end; returns (log path, combined output). Fails the test on a non-zero exit."""
        p = subprocess.run(self.args(experiment, *extra), capture_output=True, text=True, timeout=timeout)
        out = p.stdout + p.stderr
        assert p.returncode == 0, f"flashdraft run {experiment} exited {p.returncode}:\n{out}"
        return log_path_of(out), out

    def start(self, experiment: Path, output: Path, *extra: str) -> subprocess.Popen:
        """Starts a run in the background, output to a file."""
        with open(output, "w") as f:
            return subprocess.Popen(self.args(experiment, *extra), stdout=f, stderr=subprocess.STDOUT)


def log_path_of(output: str) -> Path:
    m = re.search(r"^log: (.+\.h5)\s*$", output, re.M)
    assert m, f"no 'log: PATH' line in the output:\n{output}"
    return Path(m.group(1))


@pytest.fixture(scope="session")
def flashdraft():
    fd = Flashdraft()
    fd.check()
    return fd


@pytest.fixture(scope="session")
def finished_toy_run(flashdraft, tmp_path_factory):
    """A finished 6-step toy run whose backward falls back to 'other/bwd' after
    6 backward calls (2 layers: steps 3..5), with on_fallback = "warn".
    Returns (log path, CLI output)."""
    folder = tmp_path_factory.mktemp("finished")
    exp = flashdraft.toy_experiment(folder, "finished", 6, 'on_fallback = "warn"\n'
                                    '[kernels.toy_kernel]\nbackward_variant = "other/bwd"\nfallback_after = 6\n')
    return flashdraft.run(exp)


def _with_kernels(text: str, kernel: str) -> str:
    """The experiment text with [attention] kernels = ["kernel"] (replaced or added)."""
    lines = text.splitlines()
    section, start, done = None, None, False
    for i, line in enumerate(lines):
        s = line.strip()
        if s.startswith("[") and not s.startswith("[["):
            section = s.strip("[]").strip()
            if section == "attention":
                start = i
        elif section == "attention" and re.match(r"kernels\s*=", s):
            if "]" not in s:
                raise ValueError("multi-line [attention] kernels lists are not handled by this test")
            lines[i] = f'kernels = ["{kernel}"]'
            done = True
    if not done:
        if start is None:
            lines += ["", "[attention]", f'kernels = ["{kernel}"]']
        else:
            lines.insert(start + 1, f'kernels = ["{kernel}"]')
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="session")
def notebook_runs(flashdraft, tmp_path_factory):
    """Two finished runs differing only in the attention kernel, for the notebook
    and the comparisons: experiments/quickstart.toml (6 steps) with flash_cpu and
    dense_ref when it exists, else the toy plugins with toy_kernel and dense_ref.
    Returns [(log path, kernel), (log path, kernel)]."""
    folder = tmp_path_factory.mktemp("notebook")
    runs = []
    if QUICKSTART.is_file():
        import tomllib
        text = QUICKSTART.read_text()
        cfg = tomllib.loads(text)
        # The copy lives in a temp folder: relative plugin folders are passed as
        # absolute --plugin-path instead.
        extra = []
        for d in cfg.get("plugins", {}).get("paths", []):
            extra += ["--plugin-path", str((QUICKSTART.parent / d).resolve())]
        # The quickstart's model and data generator on fewer sequences (64 training, 8 held
        # out, as the quickstart-equivalence tests): the notebook reads the same log layout.
        text = re.sub(r"\ntrain_sequences = [0-9]+", "\ntrain_sequences = 64", text)
        text = re.sub(r"\neval_sequences = [0-9]+", "\neval_sequences = 8", text)
        for kernel in ("flash_cpu", "dense_ref"):
            exp = folder / f"quickstart_{kernel}.toml"
            exp.write_text(_with_kernels(text, kernel))
            # One output folder: the second run reuses the first one's data cache
            # and gets the next log name (quickstart-1.h5).
            log, _ = flashdraft.run(exp, "--steps", "6", "--out", str(folder / "runs"), *extra, timeout=600)
            runs.append((log, kernel))
    else:
        for kernel in ("toy_kernel", "dense_ref"):
            exp = flashdraft.toy_experiment(folder, f"toy_{kernel}", 6, kernels=(kernel,))
            log, _ = flashdraft.run(exp)
            runs.append((log, kernel))
    return runs
