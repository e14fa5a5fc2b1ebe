"""test_served_moe.py's served comparison against z-lab's `dflash_generate` for the targets with attention of their
own kind: gpt-oss (attention sinks, sliding layers; and target verification in chunks), DeepSeek-V3 (multi-head
latent attention), Mistral 4 (the same with Ministral 3's query scale and a softmax router over groups), and the dense Gemma 3 (sliding layers with their own RoPE, sandwich norms), SmolLM3 (NoPE layers)
OLMo 3 (sliding layers with their own RoPE, the full ones' YaRN; no norm before attention or the MLP, q / k normed
over all heads), GLM-4 (its rotated pairs interleaved, four norms a layer), EXAONE 4.0 (sliding layers that rotate,
full ones that do not, OLMo's norms), Cohere 2 (one LayerNorm a layer feeding attention and the MLP in parallel,
its full layers without RoPE) and Gemma 4 (full layers of wider heads, proportional RoPE, per-layer embeddings, the last
layers attending with earlier layers' keys and values). A file of its own so that ctest runs it beside test_served_moe.py."""
import pytest

from test_served_moe import check_family


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3", "mistral4"])
def test_greedy_equals_the_reference_loop_with_a_mixture_of_experts_target_of_another_attention(family,
                                                                                                 tmp_path_factory):
    check_family(family, tmp_path_factory)


@pytest.mark.parametrize("family", ["gemma3", "smollm3", "olmo3", "glm4", "exaone4", "cohere2", "gemma4_ple"])
def test_greedy_equals_the_reference_loop_with_a_dense_target_of_its_own_rope(family, tmp_path_factory):
    """Gemma 3 (sliding layers with their own RoPE, the full one's scaled; four norms a layer; the embedding scaled),
    SmolLM3 (a NoPE layer), OLMo 3 (its norms after attention and the MLP only), GLM-4 (interleaved pairs
    de-interleaved at load, its keys cached so), EXAONE 4.0 (its full layer without RoPE), Cohere 2 (parallel layers
    in the cached decoder and the verification) and Gemma 4 E2B / E4B's kind (its full layers' wider heads cached apart,
    proportional RoPE, each layer's scalar and per-layer input, the shared layers reading their sources' cache): the
    cached decoder's and the verification's per-layer tables, widths and norms against transformers'. (Gemma 4's
    values equal to its keys, attention_k_eq_v, are the keys' weights loaded twice: test_hf_target.py's states.)"""
    check_family(family, tmp_path_factory)
