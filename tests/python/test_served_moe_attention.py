"""test_served_moe.py's served comparison against z-lab's `dflash_generate` for the mixtures of experts with
attention of their own kind: gpt-oss (attention sinks, sliding layers; and target verification in chunks) and
DeepSeek-V3 (multi-head latent attention). A file of its own so that ctest runs it beside test_served_moe.py."""
import pytest

from test_served_moe import check_family


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_greedy_equals_the_reference_loop_with_a_mixture_of_experts_target_of_another_attention(family,
                                                                                                 tmp_path_factory):
    check_family(family, tmp_path_factory)
