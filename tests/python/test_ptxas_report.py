"""kernels/flash_cuda/ptxas_report.py: the table of registers and spills that build.sh
prints, read from a ptxas resource report written here (the lines nvcc -Xptxas -v prints)."""
import importlib.util
import subprocess
import sys

from conftest import SOURCE_DIR

SCRIPT = SOURCE_DIR / "kernels" / "flash_cuda" / "ptxas_report.py"
spec = importlib.util.spec_from_file_location("ptxas_report", SCRIPT)
ptxas_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ptxas_report)

DQ = "_ZN10flashdraft10flash_cuda6detail19flash_bwd_dq_kernelI13__nv_bfloat16Li128ELi1ELi2EEEvNS0_11FlashParamsEPKfS6_iPKi"
DKDV = "_ZN10flashdraft10flash_cuda6detail21flash_bwd_dkdv_kernelI6__halfLi64ELi2ELb1EEEvNS0_11FlashParamsEPKfS6_iPKiPf"
WS = ("_ZN10flashdraft10flash_cuda6detail47_GLOBAL__N__58f42fad_14_flash_sm90a_cu_5b78d82c18ws_bwd_dkdv_kernel"
      "I13__nv_bfloat16Li128ELi2EEEvNS0_11FlashParamsEPKfS7_iPKi")
REF = "_Z8ref_dkdvI6__halfEv7RefArgs"


def entry(name, arch, regs, stores, loads, stack):
    return (f"ptxas info    : Compiling entry function '{name}' for '{arch}'\n"
            f"ptxas info    : Function properties for {name}\n"
            f"    {stack} bytes stack frame, {stores} bytes spill stores, {loads} bytes spill loads\n"
            f"ptxas info    : Used {regs} registers, used 1 barriers, {stack} bytes cumulative stack size\n")


def test_names_of_the_project_kernels():
    assert ptxas_report.short_name(DQ) == "flash_bwd_dq_kernel<bf16, 128, 1, 2>"
    assert ptxas_report.short_name(DKDV) == "flash_bwd_dkdv_kernel<fp16, 64, 2, true>"
    assert ptxas_report.short_name(WS) == "ws_bwd_dkdv_kernel<bf16, 128, 2>"
    assert ptxas_report.short_name(REF) == "ref_dkdv<fp16>"
    assert ptxas_report.short_name("plain_c_name") == "plain_c_name"


def test_table_puts_spilling_kernels_first_and_filters(tmp_path):
    log = tmp_path / "ptxas.log"
    # the dK/dV entry twice, as build.sh's report has it (two objects hold the kernel)
    log.write_text(entry(DKDV, "sm_90", 225, 0, 0, 0) + "ptxas info    : 0 bytes gmem\n" +
                   entry(DQ, "sm_120", 255, 236, 252, 176) + entry(REF, "sm_90", 40, 0, 0, 0) +
                   entry(DKDV, "sm_90", 225, 0, 0, 0))
    out = subprocess.run([sys.executable, str(SCRIPT), str(log), "flash_"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0].startswith("| kernel | arch | registers |")
    assert out[2] == "| flash_bwd_dq_kernel<bf16, 128, 1, 2> | sm_120 | 255 | 236 | 252 | 176 |"
    assert out[3] == "| flash_bwd_dkdv_kernel<fp16, 64, 2, true> | sm_90 | 225 | 0 | 0 | 0 |"
    assert len(out) == 4  # ref_dkdv filtered out, the repeated entry listed once


def test_a_file_without_entries_is_refused(tmp_path):
    log = tmp_path / "not_ptxas.log"
    log.write_text("nvcc warning : something\n")
    r = subprocess.run([sys.executable, str(SCRIPT), str(log)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "holds no 'Compiling entry function' entry" in r.stderr
