"""Tiny random Hugging Face decoder checkpoints made with transformers for the tests
(random init, save_pretrained; nothing is downloaded)."""
import json
from pathlib import Path

import torch
import transformers

SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)

# The hybrid families' (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) Gated DeltaNet and attention shapes, their experts'.
HYBRID = dict(tie_word_embeddings=False, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention"] * 2)
HYBRID_EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
QWEN3_5_ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                    mrope_interleaved=True)

# (name, config class, model class, extra config keys, save_pretrained keys)
FAMILIES = [
    ("llama", "LlamaConfig", "LlamaForCausalLM",
     dict(attention_bias=True, tie_word_embeddings=False,
          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                            original_max_position_embeddings=64), rope_theta=50000.0), {}),
    ("mistral", "MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=True, sliding_window=None), {}),
    ("qwen2", "Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False, rope_theta=1e6),
     dict(max_shard_size="60KB")),
    # Ministral's kind (MinistralForCausalLM: Ministral-8B): Mistral's layers, its sliding ones listed by layer_types
    # (layers 0 and 2 over the last 6 positions).
    ("ministral", "MinistralConfig", "MinistralForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, sliding_window=6, rope_theta=1e6,
          layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]), {}),
    # Meta's CWM (CwmForCausalLM): Llama's layers, every fourth layer full (CwmConfig's layer_types: layer 0 here), the
    # others over the last 6 positions, Llama 3.1's RoPE scaling (factor 4 over 16, so that it bites at this size).
    ("cwm", "CwmConfig", "CwmForCausalLM",
     dict(tie_word_embeddings=False, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
          rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=4.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=16)), {}),
    # Sliding-window attention (Mistral-7B-v0.1's kind: every layer sees the last 6 positions; Qwen2's
    # use_sliding_window: layers 2 and 3, from max_window_layers on, saved as layer_types).
    ("mistral_swa", "MistralConfig", "MistralForCausalLM", dict(tie_word_embeddings=True, sliding_window=6), {}),
    ("qwen2_swa", "Qwen2Config", "Qwen2ForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=1e6, use_sliding_window=True, sliding_window=6, max_window_layers=2),
     {}),
    ("qwen3", "Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True, head_dim=24, rope_theta=1e6), {}),
    # Phi-3 / Phi-4's kind: q|k|v and gate|up stored packed (self_attn.qkv_proj, mlp.gate_up_proj); three
    # quarters of each head rotated (Phi-4-mini's partial_rotary_factor 0.75: 12 of 16).
    ("phi3", "Phi3Config", "Phi3ForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=1e4, partial_rotary_factor=0.75, sliding_window=None,
          bos_token_id=1, eos_token_id=2, pad_token_id=0), {}),
    # A mixture of experts (Qwen3-30B-A3B's kind): 8 experts, 2 a token, renormalised; layer 2 dense
    # (mlp_only_layers), the others sparse.
    ("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
     dict(tie_word_embeddings=False, head_dim=24, rope_theta=1e6, num_experts=8, num_experts_per_tok=2,
          moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[2]), {}),
    # Qwen1.5-MoE / Qwen2-MoE's kind: q / k / v biases, 8 experts, 2 a token, not renormalised; a shared
    # expert of width 48 on every token, times the sigmoid of its gate; layer 0 dense.
    ("qwen2_moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=1e6, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
          shared_expert_intermediate_size=48, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[0]), {}),
    # Mixtral's kind (saved as block_sparse_moe.experts.E.w1 / w3 / w2): 8 experts of
    # intermediate_size, 2 a token, every layer sparse, the top 2 renormalised and kept in float32.
    ("mixtral", "MixtralConfig", "MixtralForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=1e6, num_local_experts=8, num_experts_per_tok=2, sliding_window=None),
     {}),
    # GLM-4.5's kind: half of each head rotated (partial_rotary_factor 0.5), q / k / v biases and
    # norms; layer 0 dense, the others 8 experts of 32 in 4 groups, 2 a token from the best 2 groups
    # by a sigmoid router with correction biases, times 2.5, plus one shared expert.
    ("glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=1e6, attention_bias=True, use_qk_norm=True, n_routed_experts=8,
          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
          topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True), {}),
    # MiniMax-M2's kind (MiniMaxM2ForCausalLM; M2.1, M2.5): q and k each normed over all their heads at once, half of
    # each head rotated (rotary_dim 8 of 16, as published: its key, not partial_rotary_factor), every layer 8 experts of
    # intermediate_size stored as Mixtral's, 2 a token by a sigmoid router with correction biases, no groups.
    ("minimax_m2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, rotary_dim=8, num_local_experts=8, num_experts_per_tok=2,
          rope_theta=5e6, bos_token_id=1, eos_token_id=2), {}),
    # gpt-oss's kind: a learned sink logit per head in every attention softmax, biases on q / k / v / o,
    # layers 0 and 2 sliding (window 6: transformers' default layer_types), 8 experts of intermediate_size,
    # 2 a token, with biases on the router and the experts, the GLU clamped (limit 0.2 here, not 7: a
    # random model's products reach it); YaRN as published (factor 32, bounds 32 / 1 not truncated)
    # over a pretraining length of 8 (x 32 = max_position_embeddings).
    ("gpt_oss", "GptOssConfig", "GptOssForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=6,
          swiglu_limit=0.2, rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0, beta_fast=32.0,
                                                 beta_slow=1.0, truncate=False, original_max_position_embeddings=8)),
     {}),
    # Qwen3.5's kind (hybrid): layers 0 and 2 Gated DeltaNet (2 key heads of 16 for 4 value heads of 8, a
    # convolution of 4 taps), 1 and 3 attention with an output gate (q_proj twice the rows), a quarter of each
    # head rotated (8 of 32), every norm 1 + w; mrope's sections as published (text positions: plain RoPE).
    ("qwen3_5", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(HYBRID, rope_parameters=QWEN3_5_ROPE), {}),
    # Qwen3.5-MoE's kind: the same hybrid layers, every MLP 8 experts of 32, 2 a token (always renormalised),
    # and a shared expert of 48 behind a sigmoid gate.
    ("qwen3_5_moe", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
     dict(HYBRID, **HYBRID_EXPERTS, rope_parameters=QWEN3_5_ROPE), {}),
    # Qwen3-Next's kind: the same hybrid layers, its Gated DeltaNet's projections packed per key head
    # (in_proj_qkvz, in_proj_ba); layer 0's MLP dense (mlp_only_layers), the others 8 experts of 32, 2 a token, not
    # renormalised, and a gated shared expert of 48.
    ("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM",
     dict(HYBRID, **HYBRID_EXPERTS, norm_topk_prob=False, mlp_only_layers=[0], decoder_sparse_step=1, rope_theta=1e7,
          partial_rotary_factor=0.25), {}),
    # DeepSeek-V3's kind (Kimi-K2, Moonlight): multi-head latent attention (q from a rank-24 latent, keys and values
    # from a rank-16 one, 16 + 8 dimensions of q / k a head, the 8 rotated with their pairs interleaved, 12 of v),
    # YaRN with mscale_all_dim (the softmax scale's factor); layer 0 dense, the others GLM-4.5's kind of router (8
    # experts in 4 groups, 2 a token from the best 2 groups, times 2.5) and one shared expert.
    # Tencent's Youtu-LLM (YoutuForCausalLM): DeepSeek-V3's latent attention (pairs interleaved) with a dense MLP in
    # every layer, tied embeddings.
    ("youtu", "YoutuConfig", "YoutuForCausalLM",
     dict(tie_word_embeddings=True, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
          v_head_dim=12, num_key_value_heads=4, rope_interleave=True, rope_theta=1e4, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    ("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM",
     dict(tie_word_embeddings=False, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
          v_head_dim=12, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
          n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=32, routed_scaling_factor=2.5,
          norm_topk_prob=True, rope_interleave=True,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                               mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)), {}),
    # DeepSeek-V2's kind (DeepSeek-V2 / V2.5, Coder-V2): V3's latent attention (q from a rank-24 latent; YaRN with
    # mscale_all_dim) with a float32 softmax router: 2 of 8 experts a token from the best of 4 groups (each rated by its
    # best score: group_limited_greedy; with 2 groups kept, the top 2 are always among them), times 2.5, not
    # renormalised, plus one shared expert; layer 0 dense.
    ("deepseek_v2", "DeepseekV2Config", "DeepseekV2ForCausalLM",
     dict(tie_word_embeddings=False, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
          v_head_dim=12, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
          first_k_dense_replace=1, moe_intermediate_size=32, topk_method="group_limited_greedy", n_group=4,
          topk_group=1, routed_scaling_factor=2.5,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                               mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0)), {}),
    # GLM-4.7-Flash's kind (Glm4MoeLiteForCausalLM): DeepSeek-V3's latent attention (values as wide as the keys,
    # rotary pairs interleaved, plain RoPE) and GLM-4.5's router; mlp_layer_types says layers 0 and 2 are dense.
    ("glm4_moe_lite", "Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM",
     dict(tie_word_embeddings=False, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
          v_head_dim=24, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
          n_shared_experts=1, moe_intermediate_size=32, routed_scaling_factor=1.8, norm_topk_prob=True,
          mlp_layer_types=["dense", "sparse", "dense", "sparse"], rope_theta=1e6), {}),
    # Ministral 3's kind (Ministral3ForCausalLM): Mistral's layers, YaRN over a pretraining length of 16 and each query
    # times 1 + 0.1 ln(1 + floor(position / 16)) (llama_4_scaling_beta): positions 16 on are scaled.
    ("ministral3", "Ministral3Config", "Ministral3ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, sliding_window=None,
          rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=16,
                               beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)),
     {}),
    # Gemma 3's kind (Gemma3ForCausalLM): the embedding times sqrt(hidden), four norms a layer (1 + w), GELU's tanh
    # GLU, the softmax scale query_pre_attn_scalar^-1/2 (24, not head_dim 16), q / k norms; layers 0, 1 and 3 sliding
    # over 6 positions with their own RoPE (base 1e4), layer 2 full with linear scaling (factor 4, base 1e6).
    ("gemma3", "Gemma3TextConfig", "Gemma3ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=16, hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
          sliding_window=6, layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
          rope_parameters=dict(full_attention=dict(rope_type="linear", factor=4.0, rope_theta=1e6),
                               sliding_attention=dict(rope_type="default", rope_theta=1e4))), {}),
    # Gemma 4's kind (Gemma4ForCausalLM): Gemma 3's layout with norms of weight w (float32), the values normed without a
    # weight, the softmax scale 1; layers 0 and 2 sliding over 6 positions (heads of 16, 2 key / value heads, RoPE base
    # 1e4), layers 1 and 3 full with heads of 32 and one key / value head whose values are its keys (attention_k_eq_v),
    # proportional RoPE turning a quarter of the frequencies (base 1e6); each layer's learned scalar (drawn in
    # make_model); the logits soft-capped at 0.25 (tiny logits: the cap moves them).
    ("gemma4", "Gemma4TextConfig", "Gemma4ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
          attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=6, final_logit_softcapping=0.25,
          layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Gemma 4's experts block (26B-A4B's kind): the same layers, each also with 8 experts of 32 beside its MLP, 2 a
    # token, routed from the stream after attention (router.scale and per_expert_scale drawn in make_model).
    ("gemma4_moe", "Gemma4TextConfig", "Gemma4ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
          attention_k_eq_v=True, hidden_size_per_layer_input=0, sliding_window=6, final_logit_softcapping=0.25,
          layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
          enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=32,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Gemma 4 E2B / E4B's kind: per-layer embeddings of 8 a layer (their own vocabulary of 160 rows), and the last 2
    # layers attending with the keys and values of the last earlier layer of their kind (layer 2 with layer 0's, layer
    # 3 with layer 1's), their MLPs twice as wide; the full layers' values their own (no attention_k_eq_v).
    ("gemma4_ple", "Gemma4TextConfig", "Gemma4ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=16, global_head_dim=32, hidden_size_per_layer_input=8,
          vocab_size_per_layer_input=160, num_kv_shared_layers=2, use_double_wide_mlp=True, sliding_window=6,
          final_logit_softcapping=0.25,
          layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Mistral 4's kind (Mistral4ForCausalLM): DeepSeek-V3's latent attention (the family above's sizes), YaRN with its
    # query scale 1 + 0.1 ln(1 + floor(position / 16)) (llama_4_scaling_beta over a pretraining length of 16: positions
    # 16 on are scaled), layer 0 dense, the others 8 stacked experts in 4 groups, 2 a token from the best 2 groups by a
    # softmax router, renormalised, times 1.5, and one shared expert.
    ("mistral4", "Mistral4Config", "Mistral4ForCausalLM",
     dict(tie_word_embeddings=False, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
          v_head_dim=12, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
          n_shared_experts=1, first_k_dense_replace=1, moe_intermediate_size=32, routed_scaling_factor=1.5,
          norm_topk_prob=True, rope_interleave=True, pad_token_id=0, bos_token_id=1, eos_token_id=2,
          rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
                               mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0,
                               llama_4_scaling_beta=0.1)), {}),
    # AFMoE's kind (AfmoeForCausalLM: Arcee's Trinity): four norms a layer, per-head q / k norms, the attention's output
    # gated by its own gate_proj, layers 0 and 2 sliding over 6 positions and rotating, 1 and 3 full without RoPE; the
    # embedding times sqrt(hidden) (mup_enabled); layer 0 dense, the others 8 experts, 2 a token by a sigmoid router
    # with biases (drawn in make_model), renormalised, times 2, beside one shared expert's worth of MLP.
    ("afmoe", "AfmoeConfig", "AfmoeForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
          moe_intermediate_size=32, num_dense_layers=1, global_attn_every_n_layers=2, sliding_window=6,
          route_scale=2.0, mup_enabled=True, rope_theta=1e4, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Solar Open's kind (SolarOpenForCausalLM): GLM-4.5's experts in every layer (8 in 4 groups, 2 a token from the best 2,
    # times 1.5, one shared expert) under Llama's attention with q / k / v biases, every dimension rotated (base 1e6 by
    # default).
    ("solar_open", "SolarOpenConfig", "SolarOpenForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
          moe_intermediate_size=32, routed_scaling_factor=1.5, attention_bias=True, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    # Granite SWA's kind (GraniteSWAForCausalLM): Granite's multipliers, a sink logit per head (drawn in make_model),
    # layers 1 and 3 sliding over 6 positions with RoPE base 1e4, layer 0 full with base 1e6, layer 2 full without RoPE
    # (layer_rope_theta 0).
    ("granite_swa", "GraniteSWAConfig", "GraniteSWAForCausalLM",
     dict(tie_word_embeddings=True, embedding_multiplier=6.0, residual_multiplier=0.22, attention_multiplier=0.09,
          logits_scaling=2.5, sliding_window=6,
          layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
          layer_rope_theta=[1e6, 1e4, 0, 1e4], pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Granite SWA's mixture of experts (GraniteMoeSWAForCausalLM): the same attention (sinks, layers 1 and 3 sliding
    # with base 1e4, layer 0 full with 1e6, layer 2 without RoPE), every layer 8 experts of 32, 2 a token, beside a
    # shared MLP of 48.
    ("granitemoe_swa", "GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM",
     dict(tie_word_embeddings=True, embedding_multiplier=6.0, residual_multiplier=0.22, attention_multiplier=0.09,
          logits_scaling=2.5, sliding_window=6, num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
          shared_intermediate_size=48,
          layer_types=["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
          layer_rope_theta=[1e6, 1e4, 0, 1e4], pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # SmolLM3's kind (SmolLM3ForCausalLM): Llama's layers, layer 1 without RoPE (no_rope_layers' 0: NoPE).
    ("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM",
     dict(tie_word_embeddings=True, rope_theta=2e6, no_rope_layers=[1, 0, 1, 1], use_sliding_window=False,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # The first GLM-4 (GlmForCausalLM: glm-4-9b-chat-hf): GLM-4-0414's attention (half of each head rotated, pairs
    # interleaved, q / k / v biases) and packed MLP under Llama's two norms.
    ("glm", "GlmConfig", "GlmForCausalLM", dict(tie_word_embeddings=False, head_dim=16, pad_token_id=0), {}),
    # GLM-4's kind (Glm4ForCausalLM: GLM-4-9B / 32B-0414): four norms a layer (after attention, before and after the
    # MLP), gate | up packed, q / k / v biases, half of each head rotated with its pairs interleaved.
    ("glm4", "Glm4Config", "Glm4ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, partial_rotary_factor=0.5, attention_bias=True, rope_theta=1e4,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # K-EXAONE's kind (ExaoneMoeForCausalLM): EXAONE 4.0's attention (per-head q / k norms; layers 0-2 sliding over 6
    # positions and rotating, layer 3 full without RoPE: sliding_window_pattern 4) under Llama's two norms; layer 0
    # dense, the others 8 experts of 32 in 4 groups (2 a token from the best 2 groups, sigmoid with correction biases
    # drawn in make_model, times 2.5) beside one shared expert.
    ("exaone_moe", "ExaoneMoeConfig", "ExaoneMoeForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, sliding_window=6, sliding_window_pattern=4, num_experts=8,
          num_experts_per_tok=2, n_group=4, topk_group=2, num_shared_experts=1, moe_intermediate_size=32,
          first_k_dense_replace=1, routed_scaling_factor=2.5, rope_theta=1e4, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    # Kyutai's Helium (HeliumForCausalLM): Llama's layers, every norm's weight applied in float32, RoPE's pairs
    # interleaved, q / k / v biases (attention_bias; its o_proj has none).
    ("helium", "HeliumConfig", "HeliumForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, attention_bias=True, rope_theta=1e5, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    # ERNIE 4.5's kind (Ernie4_5ForCausalLM): Llama's layers, every dimension rotated with its pairs interleaved.
    ("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=16, rope_theta=5e5, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # ERNIE 4.5's mixture of experts (Ernie4_5_MoeForCausalLM): its attention, layer 0 dense, layers 1-2 8 experts of 32,
    # 2 a token, chosen by softmax + correction biases, and a shared expert; layer 3 dense (moe_layer_end_index 2).
    ("ernie4_5_moe", "Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, rope_theta=5e5, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
          moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_end_index=2, moe_layer_interval=1,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Seed-OSS's kind (SeedOssForCausalLM): Llama's layers, biases on q / k / v (attention_bias) but not on o.
    ("seed_oss", "SeedOssConfig", "SeedOssForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e7, attention_bias=True, attention_out_bias=False,
          attention_dropout=0.0, residual_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Hunyuan's dense kind (HunYuanDenseV1ForCausalLM): q / k normed per head after RoPE, q / k / v / o biases, its
    # base stretched by a fixed NTK alpha (rope_scaling "dynamic" with alpha, as published).
    ("hunyuan", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=16, attention_bias=True,
          rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, alpha=50.0, factor=1.0),
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # EXAONE 4.0's kind (Exaone4ForCausalLM): OLMo's norms after attention and the MLP only, Qwen3's per-head q / k
    # norms; layers 0-2 sliding over 6 positions and rotating, layer 3 full without RoPE (sliding_window_pattern 4).
    ("exaone4", "Exaone4Config", "Exaone4ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, sliding_window=6, sliding_window_pattern=4, rope_theta=1e6,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # OLMo 2's kind (Olmo2ForCausalLM): no norm before attention or the MLP, their outputs normed before the residual
    # adds, q / k normed over all heads, every norm's weight applied in float32; q / k / v / o biases (attention_bias).
    ("olmo2", "Olmo2Config", "Olmo2ForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=5e5, attention_bias=True, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    # OLMo 3's kind (Olmo3ForCausalLM): OLMo 2's layers, layers 0, 1 and 3 sliding over 6 positions with their own
    # unscaled RoPE, layer 2 full with YaRN (factor 4 over a pretraining length of 16).
    ("olmo3", "Olmo3Config", "Olmo3ForCausalLM",
     dict(tie_word_embeddings=False, sliding_window=6, pad_token_id=0, bos_token_id=1, eos_token_id=2,
          layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
          rope_parameters=dict(full_attention=dict(rope_type="yarn", rope_theta=5e5, factor=4.0,
                                                   original_max_position_embeddings=16),
                               sliding_attention=dict(rope_type="default", rope_theta=1e4))), {}),
    # Granite's kind (GraniteForCausalLM: Granite 3.x dense): Llama's layers, q / k / v / o biases, the embedding times
    # 6, each attention / MLP output times 0.22 before its residual add, the softmax scale 0.09 (not 16^-1/2), the
    # logits divided by 2.5 (Granite-3.3-8B's kind of multipliers: 12, 0.22, 1/128, 16).
    ("granite", "GraniteConfig", "GraniteForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e7, attention_bias=True, embedding_multiplier=6.0,
          residual_multiplier=0.22, attention_multiplier=0.09, logits_scaling=2.5, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    # Granite 3.x's mixtures of experts (GraniteMoeForCausalLM; GraniteMoeSharedForCausalLM with a shared MLP of 48):
    # Granite's multipliers, every layer 8 experts of intermediate_size stored stacked, 2 a token (the softmax of the
    # top 2 logits).
    ("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=1e4, num_local_experts=8, num_experts_per_tok=2,
          embedding_multiplier=6.0, residual_multiplier=0.22, attention_multiplier=0.09, logits_scaling=2.5,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    ("granitemoe_shared", "GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
     dict(tie_word_embeddings=True, rope_theta=1e4, num_local_experts=8, num_experts_per_tok=2,
          shared_intermediate_size=48, embedding_multiplier=6.0, residual_multiplier=0.22, attention_multiplier=0.09,
          logits_scaling=2.5, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # dots.llm1's kind (Dots1ForCausalLM): Qwen3's attention with GLM-4.5's experts (layer 0 dense, the others 8 experts
    # of 32 in 4 groups, 2 a token from the best 2 groups by a sigmoid router with correction biases, times 2.5, plus one
    # shared expert).
    ("dots1", "Dots1Config", "Dots1ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e6, n_routed_experts=8, num_experts_per_tok=2,
          n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=4, topk_group=2,
          routed_scaling_factor=2.5, norm_topk_prob=True, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Hunyuan's mixture of experts (HunYuanMoEV1ForCausalLM: Hunyuan-A13B): Hunyuan's attention (q / k normed after
    # RoPE, q / k / v / o biases, NTK alpha), every layer 8 experts of intermediate_size, 2 a token by a float32 softmax
    # router, renormalised, and an ungated shared MLP.
    ("hunyuan_moe", "HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, attention_bias=True, num_experts=8, moe_topk=2,
          rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, alpha=50.0, factor=1.0),
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Cohere 2's kind (Cohere2ForCausalLM: Command R7B, Command A): one LayerNorm a layer feeding the attention and the
    # MLP in parallel, q / k / v / o biases, rotated pairs interleaved, layers 0-2 sliding over 6 positions and
    # rotating, layer 3 full without RoPE (sliding_window_pattern 4, saved as layer_types); the logits times 0.4.
    ("cohere2", "Cohere2Config", "Cohere2ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=16, attention_bias=True, sliding_window=6, logit_scale=0.4,
          rope_theta=5e4, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Cohere's kind (CohereForCausalLM: Command R, Aya Expanse): the same parallel layers, every layer rotating, the
    # logits times CohereConfig's 0.0625.
    ("cohere", "CohereConfig", "CohereForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e4, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # OLMoE's kind (OlmoeForCausalLM: OLMoE-1B-7B): Llama's norms, q / k normed over all heads and clamped to +-0.5
    # (clip_qkv, which this random model's q / k / v reach), every layer 8 experts of intermediate_size, 2 a token by a
    # softmax router, not renormalised.
    ("olmoe", "OlmoeConfig", "OlmoeForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=1e4, num_experts=8, num_experts_per_tok=2, clip_qkv=0.5,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # FlexOlmo's kind (FlexOlmoForCausalLM): OLMo 2's layers (norms after attention and the MLP only, q / k normed over
    # all heads, weights applied in float32) with OLMoE's experts, renormalised here.
    ("flex_olmo", "FlexOlmoConfig", "FlexOlmoForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=5e5, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Arcee's kind (ArceeForCausalLM: AFM-4.5B): Llama's layers with an ungated MLP, down(relu(up h)^2).
    ("arcee", "ArceeConfig", "ArceeForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, rope_theta=1e4, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Llama 4's kind (Llama4ForCausalLM; Scout's and Maverick's language models): layers 0-2 rotate (pairs interleaved),
    # their q / k L2-normed after RoPE, their attention in chunks of 16 positions; layer 3 without RoPE, its queries
    # scaled by 1 + 0.3 ln(1 + floor((position + 1) / 8)); layers 1 and 3 8 experts of 32, 2 a token (Scout and
    # Maverick route 1), each one's input times the sigmoid of its logit, plus a shared expert; layers 0 and 2 a dense
    # MLP of 96.
    ("llama4", "Llama4TextConfig", "Llama4ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=8,
          num_experts_per_tok=2, interleave_moe_layer_step=2, attention_chunk_size=16, floor_scale=8, attn_scale=0.3,
          rope_theta=5e5, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # The same with chunks of 128 positions, which served decoding's sequences (< 64 positions) never leave: served
    # decoding and target verification run without chunks and refuse a sequence that reaches past one.
    ("llama4_chunk128", "Llama4TextConfig", "Llama4ForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, intermediate_size=32, intermediate_size_mlp=96, num_local_experts=8,
          num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=128, floor_scale=8, attn_scale=0.3,
          rope_theta=5e5, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Granite 4.0's kind with attention layers only (GraniteMoeHybridForCausalLM: Granite-4.0-micro): Granite's
    # multipliers, each layer's MLP the shared one (96 wide) alone, RoPE; and with 8 experts of 32 (2 a token) beside a
    # shared MLP of 48, without RoPE (position_embedding_type null: Granite 4.0's NoPE).
    ("granite4", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
     dict(tie_word_embeddings=False, layer_types=["attention"] * 4, num_local_experts=0, shared_intermediate_size=96,
          position_embedding_type="rope", rope_theta=1e4, embedding_multiplier=6.0, residual_multiplier=0.22,
          attention_multiplier=0.09, logits_scaling=2.5, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    ("granite4_moe", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
     dict(tie_word_embeddings=False, layer_types=["attention"] * 4, num_local_experts=8, num_experts_per_tok=2,
          intermediate_size=32, shared_intermediate_size=48, position_embedding_type=None, embedding_multiplier=6.0,
          residual_multiplier=0.22, attention_multiplier=0.09, logits_scaling=2.5, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    # Granite 4.0-H's kind (GraniteMoeHybridForCausalLM with Mamba-2 layers: Granite-4.0-H-Tiny / Small / Micro):
    # Mamba-2 layers 0, 1 and 3 beside attention layer 2 (the published "mamba" / "attention" names), 8 heads of 16
    # (mamba_expand 2), 2 groups of B and C of 16, 4 taps with a bias, chunks of 16 positions (so that the tests'
    # sequences cross chunks), time_step_limit the default (0, inf) as published (transformers writes its inf as
    # {"__float__": "Infinity"}); experts beside the shared MLP, NoPE, as Granite-4.0-H-Tiny.
    ("granite4_h", "GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
     dict(tie_word_embeddings=False, layer_types=["mamba", "mamba", "attention", "mamba"], num_local_experts=8,
          num_experts_per_tok=2, intermediate_size=32, shared_intermediate_size=48, position_embedding_type=None,
          mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
          embedding_multiplier=6.0, residual_multiplier=0.22, attention_multiplier=0.09,
          logits_scaling=2.5, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Nemotron-H's kind (NemotronHForCausalLM: Nemotron-H-8B, NVIDIA-Nemotron-Nano-9B-v2): one block a layer, as its
    # published hybrid_override_pattern says: a Mamba-2 block (8 heads of 16, 2 groups of B and C of 16, chunks of 16),
    # an MLP block (ReLU², 96 wide), attention without RoPE (4/2 heads of 16), an MLP block.
    ("nemotron_h", "NemotronHConfig", "NemotronHForCausalLM",
     dict(tie_word_embeddings=False, hybrid_override_pattern="M-*-", head_dim=16, mamba_num_heads=8,
          mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16, conv_kernel=4, layer_norm_epsilon=1e-5,
          pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Nemotron 3's kind (NemotronHForCausalLM with experts blocks: NVIDIA-Nemotron-3-Nano-30B-A3B): a Mamba-2 block, an
    # experts block, attention, an experts block; 8 ungated ReLU² experts of 32 (2 a token) chosen by the sigmoid router
    # with correction biases among the best 2 of 4 groups, their weights renormalised and times 2.5, beside a shared
    # ReLU² MLP of 48.
    ("nemotron_h_moe", "NemotronHConfig", "NemotronHForCausalLM",
     dict(tie_word_embeddings=False, hybrid_override_pattern="ME*E", head_dim=16, mamba_num_heads=8,
          mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16, conv_kernel=4, layer_norm_epsilon=1e-5,
          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
          n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, pad_token_id=0, bos_token_id=1,
          eos_token_id=2), {}),
    # Nemotron 3 Super's kind: nemotron_h_moe's blocks with the routed experts in a latent width of 24
    # (moe_latent_size: mixer.fc1_latent_proj before them, fc2_latent_proj after their sum; the router and the shared
    # MLP read the hidden rows).
    ("nemotron_h_latent", "NemotronHConfig", "NemotronHForCausalLM",
     dict(tie_word_embeddings=False, hybrid_override_pattern="ME*E", head_dim=16, mamba_num_heads=8,
          mamba_head_dim=16, ssm_state_size=16, n_groups=2, chunk_size=16, conv_kernel=4, layer_norm_epsilon=1e-5,
          n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
          moe_latent_size=24, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, pad_token_id=0,
          bos_token_id=1, eos_token_id=2), {}),
    # Bamba's kind (BambaForCausalLM: Bamba-9B): Mamba-2 layers (Granite 4.0-H's sizes) with attention at layer 2
    # (attn_layer_indices), half of each head rotated, Llama's SwiGLU MLP under feed_forward.
    ("bamba", "BambaConfig", "BambaForCausalLM",
     dict(tie_word_embeddings=False, attn_layer_indices=[2], mamba_n_heads=8, mamba_n_groups=2, mamba_d_state=16,
          mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, pad_token_id=0, bos_token_id=1, eos_token_id=2), {}),
    # Apertus's kind (ApertusForCausalLM: Apertus-8B / 70B): per-head q / k norms, its norms' own names, an ungated MLP
    # through xIELU with learned alpha_p / alpha_n (drawn away from their initial values here), llama3 RoPE.
    ("apertus", "ApertusConfig", "ApertusForCausalLM",
     dict(tie_word_embeddings=False, head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
          rope_parameters=dict(rope_type="llama3", rope_theta=1.2e7, factor=8.0, low_freq_factor=1.0,
                               high_freq_factor=4.0, original_max_position_embeddings=64)), {}),
    # YaRN (Qwen3 and Llama 3.1 serve 128K with it): the defaults (attention factor from the
    # factor, bounds 32 / 1 truncated), and every key set (mscale over mscale_all_dim, other
    # bounds, no truncation). Pretraining lengths of 64 and 32 positions: the YaRN test's 100
    # positions run past them.
    ("qwen3_yarn", "Qwen3Config", "Qwen3ForCausalLM",
     dict(tie_word_embeddings=True, head_dim=24, rope_theta=1e6,
          rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64)), {}),
    ("llama_yarn", "LlamaConfig", "LlamaForCausalLM",
     dict(tie_word_embeddings=False, rope_theta=10000.0,
          rope_scaling=dict(rope_type="yarn", factor=8.0, original_max_position_embeddings=32, mscale=0.707,
                            mscale_all_dim=1.0, beta_fast=16.0, beta_slow=2.0, truncate=False)), {}),
]


def make_model(folder: Path, family: str, seed: int = 0, embedding_std: float = 0.0, **overrides):
    """Writes a random model of `family` to `folder`; returns the transformers model (fp32, eval).
    embedding_std > 0 redraws the embedding (and a tied LM head) with that deviation: a head
    whose logits can separate tokens, for training tests."""
    name, config_cls, model_cls, extra, save = next(f for f in FAMILIES if f[0] == family)
    if not hasattr(transformers, config_cls):  # (a family newer than this transformers)
        import pytest
        pytest.skip(f"transformers {transformers.__version__} has no {config_cls}")
    config = getattr(transformers, config_cls)(**{**SMALL, **extra, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # norms away from 1 so that a missing or misplaced norm shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("self_attn.sinks"):  # gpt-oss: sinks that take a real share of each softmax
                p.uniform_(0.5, 2.5)
            elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "mlp.router.weight",
                             "block_sparse_moe.router.weight", "mlp.gate.wg.weight",
                             "feed_forward.router.weight", "mixer.gate.weight",
                             "router.proj.weight", "router.gate.weight")):  # a router whose choices and
                p.normal_(0, 0.5)  # weights are far from even; a shared expert's gate far from 1/2
            elif n.endswith("bias"):
                p.normal_(0, 0.1)
            elif n.endswith(("mamba.D", "mamba.dt_bias", "mixer.D", "mixer.dt_bias")):  # Mamba-2 (Granite's mamba.,
                p.uniform_(-1.0, 1.0)  # Nemotron-H's mixer.): each head's skip and time step its own
            elif n.endswith(("mamba.A_log", "mixer.A_log")):  # decays from slow to fast
                p.uniform_(-2.0, 1.0)
            elif n.endswith(("mamba.in_proj.weight", "mamba.conv1d.weight", "mixer.in_proj.weight",
                             "mixer.conv1d.weight")):  # B and C of order 1: the state's part of the output far from
                p.normal_(0, 0.15 if "in_proj" in n else 0.5)  # negligible beside D x
            elif n.endswith(("act_fn.alpha_p", "act_fn.alpha_n")):  # Apertus's xIELU: each layer's own slopes
                p.uniform_(-1.0, 1.0)
            elif n.endswith(("router.scale", "router.per_expert_scale")):  # Gemma 4's router: its own scales
                p.uniform_(0.5, 1.5)
            elif n.endswith("mlp.expert_bias"):  # AFMoE's router biases: choices unlike the scores' alone
                p.normal_(0, 0.05)
            elif embedding_std > 0 and ("embed_tokens" in n or n == "lm_head.weight"):
                p.normal_(0, embedding_std)
        for n, b in model.named_buffers():  # GLM-4.5's router biases: choices unlike the scores' alone
            if n.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
            elif n.endswith("layer_scalar"):  # Gemma 4: each layer's output scale its own
                b.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True, **save)
    return model


def edit_config(folder: Path, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
