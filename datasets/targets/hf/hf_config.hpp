// config.json of a Hugging Face decoder checkpoint, as the hf target reads it: the
// dense decoder families LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM,
// Qwen3ForCausalLM and Phi3ForCausalLM (Phi-3, Phi-4: q|k|v and gate|up stored packed), and the mixtures of experts
// Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM, Glm4MoeForCausalLM, MiniMaxM2ForCausalLM (Mixtral's
// expert layout, GLM-4.5's sigmoid router without groups, q / k norms over all heads) and GptOssForCausalLM (gpt-oss:
// attention sinks, a clamped GLU, biases on the router and the experts, its experts in bf16 or MXFP4), and the hybrid
// Qwen3.5 (Qwen3_5ForCausalLM, or the language model of Qwen3_5ForConditionalGeneration: Gated DeltaNet layers
// between gated attention layers), Qwen3.5-MoE (Qwen3_5MoeForCausalLM / ForConditionalGeneration: the same with
// Qwen2-MoE's kind of experts and gated shared expert in every layer) and Qwen3-Next (Qwen3NextForCausalLM: the
// same kind, its Gated DeltaNet's projections packed per key head), and the others kSupportedArchitectures lists
// (DeepSeek-V3's kind, Mistral 4, Ministral, Ministral 3, Meta's CWM, the first GLM-4, K-EXAONE, Helium, Youtu-LLM,
// Qwen3-VL, Gemma 3 / 4, SmolLM3, OLMo 2 / 3, GLM-4, EXAONE 4.0, Granite and its mixtures of experts, dots.llm1,
// Hunyuan's mixture of experts, DeepSeek-V2, Cohere / Cohere 2, OLMoE / FlexOlmo, Arcee, Llama 4, Granite 4.0, Apertus,
// AFMoE: see their members below). Anything else is refused with the architecture found and the list.
#pragma once

#include <flashdraft/rope_scaling.hpp>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace flashdraft::hf {

using RopeScaling = flashdraft::RopeScaling;  // (core/include/flashdraft/rope_scaling.hpp)

struct ModelConfig {
  std::string path;          // the config.json read
  std::string architecture;  // e.g. "Qwen3ForCausalLM"
  // Where the decoder's tensors sit: "model." (model.embed_tokens, model.layers.N., model.norm), or
  // "model.language_model." for a multimodal checkpoint's language model (Qwen3_5ForConditionalGeneration,
  // Mistral3ForConditionalGeneration, whose config.json holds the decoder's keys in text_config), or
  // "language_model.model." where it is saved in its original layout (Mistral 3's, as transformers writes it).
  std::string prefix = "model.";
  std::string lm_head = "lm_head.weight";  // (a multimodal checkpoint in its original layout: language_model.lm_head.)
  // Qwen3.5 (Qwen3_5ForCausalLM / ForConditionalGeneration) and Qwen3.5-MoE (Qwen3_5Moe...)
  bool qwen3_5() const { return architecture.rfind("Qwen3_5", 0) == 0; }
  // Qwen3-VL's language model (Qwen3's layers; Qwen3-VL-MoE's experts stored as two stacked tensors a layer)
  bool qwen3_vl() const { return architecture.rfind("Qwen3VL", 0) == 0; }
  // Qwen2-VL's and Qwen2.5-VL's language models (Qwen2's layers; text_config, or as published the keys at the top with
  // rope_scaling "mrope", which a text's positions make plain RoPE; tensors under model.language_model. or model.)
  bool qwen2_vl() const {
    return architecture == "Qwen2VLForConditionalGeneration" || architecture == "Qwen2_5_VLForConditionalGeneration";
  }
  // The hybrid families of Gated DeltaNet and gated attention layers: Qwen3.5, Qwen3.5-MoE and Qwen3-Next
  // (Qwen3NextForCausalLM: its Gated DeltaNet's projections packed per key head, in_proj_qkvz and in_proj_ba)
  bool hybrid() const { return qwen3_5() || architecture == "Qwen3NextForCausalLM"; }
  int64_t vocab = 0, hidden = 0, layers = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  double rms_eps = 1e-6, rope_theta = 10000.0;
  RopeScaling rope;
  int64_t rotary_dim = 0;  // the first rotary_dim of each head's head_dim rotate (partial_rotary_factor)
  bool qk_norm = false;    // Qwen3: RMSNorm of q and k per head, before RoPE
  // MiniMax-M2 (MiniMaxM2ForCausalLM: MiniMax-M2, M2.1, M2.5): q and k normed over all their heads at once (q_norm
  // [heads D], k_norm [kv_heads D], its qk_norm_type "per_layer"), before RoPE.
  bool minimax_m2() const { return architecture == "MiniMaxM2ForCausalLM"; }
  // Meta's CWM (CwmForCausalLM): Llama's layers, every fourth layer full and the others sliding (layer_types; window
  // 8192 by default), Llama 3.1's RoPE scaling by default
  bool cwm() const { return architecture == "CwmForCausalLM"; }
  // Kyutai's Helium (HeliumForCausalLM): Llama's layers, every norm's weight applied in float32 (norm_weight_fp32),
  // RoPE's pairs interleaved (GLM's rotation), attention_bias on q / k / v only (its o_proj has none)
  bool helium() const { return architecture == "HeliumForCausalLM"; }
  // Tencent's Youtu-LLM (YoutuForCausalLM): DeepSeek-V3's latent attention (its pairs interleaved by default) with a
  // dense SwiGLU MLP in every layer
  bool youtu() const { return architecture == "YoutuForCausalLM"; }
  // Mistral's kind of attention (no biases; with sliding_window set, every layer sliding but where layer_types says):
  // Mistral, Mixtral, Ministral, Ministral 3 (and Mistral 3's language model) and CWM (its layer_types' default)
  bool mistral_kind() const {
    return architecture == "MistralForCausalLM" || architecture == "MixtralForCausalLM" ||
           architecture == "MinistralForCausalLM" || architecture == "Ministral3ForCausalLM" ||
           architecture == "Mistral3ForConditionalGeneration" || cwm();
  }
  bool qk_norm_full = false;
  bool qkv_bias = false;    // Qwen2: biases on q, k, v (and Llama's, Qwen3's attention_bias)
  bool o_bias = false;      // attention_bias (Llama, Qwen3): a bias on o too (Seed-OSS: attention_out_bias alone)
  int tie_embeddings = -1;  // 1 / 0 as config.json says; -1: not said (the weights decide)
  // Sliding-window attention: a sliding layer's query sees only the sliding_window positions ending
  // at its own (0: every layer full). Which layers slide: config.json's layer_types where it lists
  // them, else Qwen2's use_sliding_window rule (layers from max_window_layers on), else every layer
  // (Mistral, Phi-3).
  int64_t sliding_window = 0;
  std::vector<uint8_t> sliding;  // per layer
  int64_t window(int64_t layer) const {
    return sliding_window > 0 && sliding[static_cast<size_t>(layer)] ? sliding_window : 0;
  }
  // The longest position the checkpoint is made for: max_position_embeddings, or a RoPE
  // scaling's factor x its pretraining length where that is longer (as vLLM takes a model's
  // length); 0 when config.json says neither.
  int64_t max_position = 0;
  // Mixture of experts (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM, MixtralForCausalLM, Glm4MoeForCausalLM;
  // experts == 0 for the dense families): a sparse layer routes each token to experts_per_token of
  // `experts` feed-forward experts of width moe_intermediate (Qwen2- / Qwen3-MoE: num_experts, num_experts_per_tok,
  // moe_intermediate_size; Mixtral: num_local_experts, num_experts_per_tok, intermediate_size),
  // their outputs weighted by the router's softmax over the experts (renormalised over the
  // chosen ones when norm_topk_prob; always for Mixtral). Layer l is sparse unless it is in
  // mlp_only_layers or (l + 1) % decoder_sparse_step != 0; a dense layer has the usual MLP of
  // `intermediate` (Mixtral: every layer sparse). float_router_weights: the k weights stay in
  // float32, so each expert's row times its weight is not rounded to the model's dtype
  // (Mixtral's router, as transformers runs it); else they are cast to the dtype first.
  int64_t experts = 0, experts_per_token = 0, moe_intermediate = 0, sparse_step = 1;
  bool norm_topk = false, float_router_weights = false;
  std::string experts_key;  // the key config.json gives the count under (num_experts, num_local_experts, ...)
  // GLM-4.5 (Glm4MoeForCausalLM): the router's sigmoid in float32 (its weight in float32 too), the
  // experts chosen by score + a per-expert correction bias (mlp.gate.e_score_correction_bias) among
  // the topk_groups best of `groups` groups, weighted by the plain scores (renormalised when
  // norm_topk) times routed_scale; shared_experts x moe_intermediate of width every token runs
  // (mlp.shared_experts), added to the routed sum; layers below first_dense dense.
  bool sigmoid_router = false;
  // MiniMax-M2's router: its logits in the model's dtype (router weight as stored), the sigmoid in float32
  // (transformers' MiniMaxM2TopKRouter); GLM-4.5's and DeepSeek-V3's: the product in float32 too.
  bool router_logits_in_dtype = false;
  int64_t groups = 1, topk_groups = 1, shared_experts = 0, first_dense = 0;
  double routed_scale = 1.0;
  // The shared expert every token of a sparse layer runs, added to the routed sum: its width (0:
  // none; GLM-4.5: shared_experts x moe_intermediate, at mlp.shared_experts; Qwen2-MoE:
  // shared_expert_intermediate_size, at mlp.shared_expert, its output times
  // sigmoid(h mlp.shared_expert_gate^T), a [1, H] gate: shared_gate).
  int64_t shared_intermediate = 0;
  bool shared_gate = false;
  // gpt-oss (GptOssForCausalLM): every layer sparse; the router a linear layer with a bias whose top
  // k logits are softmaxed in the model's dtype; each expert's gate / up and down products with
  // biases; the GLU glu_limit-clamped, (up + 1) * gate * sigmoid(glu_alpha gate) (glu_limit 0: plain
  // SwiGLU); a learned sink logit per query head in every attention softmax (sinks); its RMSNorm's
  // weight applied in float32 before the rounding (norm_weight_fp32); experts stored as bf16
  // tensors or as MXFP4 blocks and scales (quant_method "mxfp4", dequantized at load).
  bool sinks = false, norm_weight_fp32 = false;
  double glu_alpha = 0, glu_limit = 0;
  std::string quant_method;  // quantization_config's quant_method ("" for none)
  // quant_method "fp8": every F8_E4M3 weight W [N, K] comes with W_scale_inv [ceil(N / rows), ceil(K / columns)]
  // (float32), one scale per block of weight_block_size [rows, columns]: W = fp8 values x their block's scale,
  // dequantized at load to the target's dtype (transformers' FineGrainedFP8Config(dequantize=True)).
  std::vector<int64_t> fp8_block;
  // Qwen3.5: layer_types "linear_attention" (or every full_attention_interval-th layer full, the
  // others linear) mark Gated DeltaNet layers (transformers' Qwen3_5GatedDeltaNet): q, k, v of
  // linear_num_key_heads x linear_key_head_dim (q, k) and linear_num_value_heads x linear_value_head_dim
  // (v) through a causal depthwise convolution of linear_conv_kernel_dim taps and SiLU, the gated delta
  // rule over them, a gated RMSNorm and out_proj. Its attention layers gate their output with
  // sigmoid(a second half of q_proj per head) (attn_gate), and every RMSNorm of the model but the gated
  // one scales by 1 + w in float32 (norm_plus_one; q / k norms too).
  std::vector<uint8_t> linear;  // per layer (empty: none)
  int64_t lin_k_heads = 0, lin_v_heads = 0, lin_k_dim = 0, lin_v_dim = 0, conv_kernel = 0;
  bool attn_gate = false, norm_plus_one = false;
  bool linear_attention(int64_t layer) const { return !linear.empty() && linear[static_cast<size_t>(layer)]; }
  // DeepSeek-V3's multi-head latent attention (DeepseekV3ForCausalLM: DeepSeek-V3 / R1, Kimi-K2, Moonlight): q from
  // q_lora_rank (q_a_proj, its norm, q_b_proj; 0: q_proj), keys and values from a kv_lora_rank latent
  // (kv_a_proj_with_mqa, its norm, kv_b_proj) per head: qk_nope dimensions without position, qk_rope rotated ones
  // (one rotated key shared by the heads; its pairs interleaved when rope_interleave), v_dim values. The engine
  // attends over heads of head_dim = qk_nope + qk_rope, the values padded with zeros to it; softmax_scale:
  // head_dim^-1/2 times YaRN's mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale).
  int64_t q_lora = 0, kv_lora = 0, qk_nope = 0, qk_rope = 0, v_dim = 0;
  bool rope_interleave = false;
  double softmax_scale = 0;  // 0: 1 / sqrt(head_dim)
  bool mla() const { return kv_lora > 0; }
  // DeepSeek-V2 (DeepseekV2ForCausalLM: DeepSeek-V2 / V2.5, V2-Lite, DeepSeek-Coder-V2): V3's latent attention (its
  // rotated pairs always interleaved) with a softmax router (its product and softmax in float32) that takes the top k
  // of all experts (topk_method "greedy") or of the topk_group of n_group groups with the best single scores
  // ("group_limited_greedy"), weighted by their softmax values, not renormalised, times routed_scaling_factor (kept in
  // float32); n_shared_experts shared experts; the first first_k_dense_replace layers dense.
  bool deepseek_v2() const { return architecture == "DeepseekV2ForCausalLM"; }
  // Mistral 4 (Mistral4ForCausalLM): DeepSeek-V3's latent attention (its rope_parameters' partial_rotary_factor is the
  // rotated share qk_rope / (qk_nope + qk_rope): all of the rotated part), each query times Ministral 3's
  // 1 + beta ln(1 + floor(position / length)) (query_scale_beta), its experts stacked as transformers saves them
  // (mlp.experts.gate_up_proj [E, 2 I, H], down_proj [E, H, I]) and chosen by a softmax router in the model's dtype
  // without correction biases: the top k of the topk_group of n_group groups scored by their best two, renormalised,
  // times routed_scaling_factor; n_shared_experts shared experts.
  bool mistral4() const { return architecture == "Mistral4ForCausalLM"; }
  // AFMoE (AfmoeForCausalLM: Arcee's Trinity Nano / Mini / Large): Gemma 3's four norms a layer (input_layernorm,
  // post_attention_layernorm, pre_mlp_layernorm, post_mlp_layernorm) with weights applied in float32, Qwen3's per-head
  // q / k norms, each attention output gated by sigmoid(self_attn.gate_proj h) (attn_gate's values from a tensor of
  // their own), its sliding layers (layer_types, else every global_attn_every_n_layers-th layer full) rotating and its
  // full layers not; the embedding times sqrt(hidden) where mup_enabled (embed_multiplier); past the first
  // num_dense_layers dense layers, num_experts of moe_intermediate_size chosen by a sigmoid router (logits in the
  // model's dtype) plus mlp.expert_bias, the top num_experts_per_tok renormalised, times route_scale, beside
  // num_shared_experts experts' worth of a shared MLP.
  bool afmoe() const { return architecture == "AfmoeForCausalLM"; }
  // Ministral 3 (Ministral3ForCausalLM; Mistral3ForConditionalGeneration's language model): each query times
  // 1 + beta ln(1 + floor(position / length)) after RoPE (rope_parameters' llama_4_scaling_beta and
  // original_max_position_embeddings; 1 within the pretraining length). beta 0: none.
  double query_scale_beta = 0;
  int64_t query_scale_length = 0;
  // Gemma 3 (Gemma3ForCausalLM; Gemma3ForConditionalGeneration's language model): the embedding's rows times
  // sqrt(hidden) rounded to the model's dtype (embed_scale); four norms a layer, each 1 + w in float32 (the
  // attention's output and the MLP's normed before their residual adds: sandwich_norms); the MLP's gate through
  // GELU's tanh approximation (gelu_mlp); the softmax scale query_pre_attn_scalar^-1/2; its sliding layers rotate
  // with their own RoPE (rope_local_theta, unscaled), the full ones with rope_theta and its scaling.
  bool gemma3() const { return architecture.rfind("Gemma3", 0) == 0; }
  bool embed_scale = false, sandwich_norms = false, gelu_mlp = false;
  double rope_local_theta = 0;  // 0: every layer rotates alike
  bool local_rope(int64_t layer) const { return rope_local_theta > 0 && window(layer) > 0; }
  // Gemma 4 (Gemma4ForCausalLM; Gemma4ForConditionalGeneration's language model): Gemma 3's layout (embed_scale,
  // sandwich_norms, gelu_mlp, q / k norms) with every norm's weight w applied in float32 (not 1 + w), the values
  // RMS-normed without a weight (v_norm) and the softmax scale 1. Its full layers' heads have their own width and
  // count (layer_head_dim / layer_kv_heads: per_layer_config, or global_head_dim and, with attention_k_eq_v,
  // num_global_key_value_heads), their values the keys' projection itself where attention_k_eq_v (keys_as_values),
  // rotated by proportional RoPE: of each head's D / 2 frequencies 1 / theta^(2i / D), the first rope_proportion x
  // D / 2 turn (divided by rope_factor), the rest are 0 (those dimensions pass unrotated); its sliding layers rotate
  // with rope_local_theta over head_dim. Each layer's output is times its learned layer_scalar, and the logits are
  // soft-capped, cap tanh(logits / cap) (logit_softcap: final_logit_softcapping; 0: none). With enable_moe_block
  // (26B-A4B) every layer also runs `experts` of moe_intermediate beside its MLP: routed from the stream after
  // attention (its weightless RMSNorm times router.scale and hidden^-1/2, the softmax in float32, the top
  // experts_per_token renormalised, times router.per_expert_scale), fed that stream through
  // pre_feedforward_layernorm_2, GELU-gated; the MLP's output and the experts' each normed
  // (post_feedforward_layernorm_1 / _2) and their sum normed again.
  bool gemma4() const { return architecture.rfind("Gemma4", 0) == 0; }
  bool v_norm = false, keys_as_values = false;
  double rope_proportion = 0, rope_factor = 1.0, logit_softcap = 0;
  std::vector<int64_t> layer_head_dim, layer_kv_heads;  // per layer (empty: head_dim and kv_heads in every layer)
  int64_t head_dim_of(int64_t layer) const {
    return layer_head_dim.empty() ? head_dim : layer_head_dim[static_cast<size_t>(layer)];
  }
  int64_t kv_heads_of(int64_t layer) const {
    return layer_kv_heads.empty() ? kv_heads : layer_kv_heads[static_cast<size_t>(layer)];
  }
  bool values_are_keys(int64_t layer) const { return keys_as_values && window(layer) == 0; }
  // Gemma 4 E2B / E4B. Per-layer embeddings (ple: hidden_size_per_layer_input, 0: none): each token's row of
  // embed_tokens_per_layer [vocab_size_per_layer_input, layers x ple] times sqrt(ple), plus the embedding's rows
  // through per_layer_model_projection times hidden^-1/2 and per_layer_projection_norm, the sum times 2^-1/2: a [ple]
  // input per layer, which each layer adds to its output through per_layer_input_gate (GELU), per_layer_projection and
  // post_per_layer_input_norm. Shared keys and values (num_kv_shared_layers): the last layers attend with the keys
  // and values of kv_source[l], the last earlier layer of their kind (no k / v projections of their own), their MLP
  // twice as wide where use_double_wide_mlp.
  int64_t ple = 0, ple_vocab = 0;
  std::vector<int64_t> kv_source;  // per layer: the layer whose keys and values it attends with (itself: its own)
  bool shares_kv(int64_t layer) const { return !kv_source.empty() && kv_source[static_cast<size_t>(layer)] != layer; }
  std::vector<int64_t> layer_intermediate;  // per layer (empty: intermediate everywhere)
  int64_t intermediate_of(int64_t layer) const {
    return layer_intermediate.empty() ? intermediate : layer_intermediate[static_cast<size_t>(layer)];
  }
  // OLMo 2 / OLMo 3 (Olmo2ForCausalLM, Olmo3ForCausalLM): no norm before attention or the MLP; their outputs normed
  // before the residual adds (post_attention_layernorm, post_feedforward_layernorm: post_norms, with sandwich_norms'
  // code); q / k normed over all heads (qk_norm_full); every norm's weight applied in float32 (norm_weight_fp32).
  // OLMo 3's sliding layers (layer_types, else three of every four) rotate with their own unscaled RoPE
  // (rope_local_theta), its full layers with rope_theta and its scaling (YaRN as published).
  // GLM-4 (Glm4ForCausalLM: GLM-4-9B / 32B-0414, GLM-Z1): Gemma 3's four norms a layer under other names
  // (post_self_attn_layernorm after attention, post_attention_layernorm before the MLP, post_mlp_layernorm after it),
  // gate | up stored packed (mlp.gate_up_proj), biases on q / k / v, the first rotary_dim of each head rotated with
  // their pairs interleaved (rope_interleave: de-interleaved at load, as for DeepSeek-V3's latent attention).
  // GLM-4.1V's language model (Glm4vForConditionalGeneration) is GLM-4's; GLM-4.5V's and GLM-4.6V's
  // (Glm4vMoeForConditionalGeneration) GLM-4.5's (glm4_moe); both under model.language_model., their text positions'
  // mrope plain RoPE.
  // (GLM-4.6V-Flash, Glm46VForConditionalGeneration: GLM-4.1V's kind, GLM-4's dense layers)
  bool glm4() const {
    return architecture == "Glm4ForCausalLM" || architecture == "Glm4vForConditionalGeneration" ||
           architecture == "Glm46VForConditionalGeneration";
  }
  // GLM-4's attention and packed MLP (half of each head rotated, its pairs interleaved; biases on q, k, v; gate | up
  // stored as mlp.gate_up_proj): GLM-4-0414's kind (glm4(), with two more norms a layer) and the first GLM-4
  // (GlmForCausalLM: glm-4-9b-chat-hf, Llama's two norms)
  bool glm_attention() const { return glm4() || architecture == "GlmForCausalLM"; }
  bool glm4_moe() const {
    return architecture == "Glm4MoeForCausalLM" || architecture == "Glm4vMoeForConditionalGeneration" || solar_open();
  }
  // Solar Open (SolarOpenForCausalLM: Upstage's Solar Open 100B): GLM-4.5's experts in every layer (no dense layer,
  // no first_k_dense_replace) under Llama's attention: every dimension of each head rotated (base 1e6 where
  // rope_parameters does not say), biases on q / k / v where attention_bias, none on o, no q / k norms.
  bool solar_open() const { return architecture == "SolarOpenForCausalLM"; }
  // EXAONE 4.0 (Exaone4ForCausalLM: 32B, 1.2B): OLMo's norms after attention and the MLP only (post_norms), but
  // Qwen3's per-head q / k norms, weights in the model's dtype; with sliding_window set its sliding layers
  // (layer_types, else sliding_window_pattern: every n-th full, or a string such as "LLLG" repeated from layer 0)
  // rotate and its full ones do not (nope); without it every layer is full and rotates.
  // ERNIE 4.5 (Ernie4_5ForCausalLM: 0.3B): Llama's layers, every dimension of each head rotated with its pairs
  // interleaved (rope_interleave, as GLM-4's). Seed-OSS (SeedOssForCausalLM: Seed-OSS-36B): Llama's layers, the biases
  // of q / k / v (attention_bias) and of o (attention_out_bias) set apart.
  bool ernie4_5() const { return architecture == "Ernie4_5ForCausalLM" || ernie4_5_moe(); }
  // ERNIE 4.5's mixture of experts (Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B): layers moe_layer_start_index ..
  // moe_layer_end_index (every moe_layer_interval-th) sparse, moe_num_experts of moe_intermediate_size, moe_k a token;
  // the router's softmax in float32 (its weight in float32), the top k of softmax + a per-expert correction bias
  // (mlp.moe_statics.e_score_correction_bias, [1, E]) chosen, their softmax values renormalised (the sum clamped at
  // moe_norm_min: softmax_choice_bias) and cast to the model's dtype; moe_num_shared_experts x moe_intermediate_size of
  // shared experts (mlp.shared_experts, no gate) every token runs.
  bool ernie4_5_moe() const { return architecture == "Ernie4_5_MoeForCausalLM"; }
  bool softmax_choice_bias = false;
  double norm_min = 0;
  bool seed_oss() const { return architecture == "SeedOssForCausalLM"; }
  // Hunyuan's dense models (HunYuanDenseV1ForCausalLM: Hunyuan-7B / 4B / 1.8B / 0.5B): q and k normed per head after
  // RoPE (self_attn.query_layernorm / key_layernorm: qk_norm_after_rope); its rope_scaling "dynamic" with alpha
  // stretches the base, theta alpha^(D / (D - 2)), for every length (transformers' ntk_alpha).
  bool hunyuan() const { return architecture == "HunYuanDenseV1ForCausalLM" || hunyuan_moe(); }
  // Hunyuan's mixture of experts (HunYuanMoEV1ForCausalLM: Hunyuan-A13B): Hunyuan's attention; every layer num_experts
  // of intermediate_size, moe_topk a token (each an integer, or one a layer, all equal), chosen by the float32 softmax
  // of its router (mlp.gate.wg, run in float32), renormalised and kept in float32; and one shared MLP of
  // intermediate_size every token runs, ungated (mlp.shared_mlp).
  bool hunyuan_moe() const { return architecture == "HunYuanMoEV1ForCausalLM"; }
  bool qk_norm_after_rope = false;
  // EXAONE 4.5 (Exaone4_5_ForConditionalGeneration): EXAONE 4.0's language model under model.language_model. (its
  // text_config), the vision tower not read; a text's positions make its mrope plain RoPE.
  bool exaone4() const {
    return architecture == "Exaone4ForCausalLM" || architecture == "Exaone4_5_ForConditionalGeneration";
  }
  // K-EXAONE (ExaoneMoeForCausalLM): EXAONE 4.0's attention (per-head q / k norms; with sliding_window set, its full
  // layers rotate nothing) under Llama's two norms, and DeepSeek-V3's experts (num_experts, a sigmoid router with
  // correction biases over n_group groups, times routed_scaling_factor, num_shared_experts' worth of shared MLP),
  // dense where mlp_layer_types says (default: below first_k_dense_replace).
  bool exaone_moe() const { return architecture == "ExaoneMoeForCausalLM"; }
  bool olmo() const {
    return architecture == "Olmo2ForCausalLM" || architecture == "Olmo3ForCausalLM" ||
           architecture == "FlexOlmoForCausalLM";
  }
  // OLMoE (OlmoeForCausalLM: OLMoE-1B-7B): Llama's norms, q / k normed over all heads (qk_norm_full), q / k / v clamped
  // to +-clip_qkv where set; every layer num_experts of intermediate_size, num_experts_per_tok a token by a softmax
  // router (Qwen3-MoE's: renormalised when norm_topk_prob, default false). FlexOlmo (FlexOlmoForCausalLM): OLMo 2's
  // layers (olmo()) with OLMoE's experts.
  bool olmoe() const { return architecture == "OlmoeForCausalLM" || architecture == "FlexOlmoForCausalLM"; }
  double clip_qkv = 0;  // 0: none
  bool post_norms = false;
  // Granite (GraniteForCausalLM: Granite 3.x dense): Llama's layers and four multipliers. The embedding's rows times
  // embedding_multiplier (embed_multiplier, rounded once to the model's dtype), each attention and MLP output times
  // residual_multiplier before its residual add (folded into o_proj and down_proj at load), the softmax scale
  // attention_multiplier (not head_dim^-1/2), and the logits divided by logits_scaling (logit_scale = its inverse:
  // TargetModel::logit_scale, which the target's distributions use; the LM head a drafter borrows stays as stored).
  // Granite 3.x's mixtures of experts (GraniteMoeForCausalLM; GraniteMoeSharedForCausalLM with a shared MLP): the same
  // multipliers, every layer num_local_experts of intermediate_size, num_experts_per_tok a token, their weights the
  // softmax of the top k logits (the logits in the model's dtype, the softmax in float32, cast back); the experts
  // stored stacked (block_sparse_moe.input_linear [E, gate | up, H], output_linear [E, H, I], router.layer [E, H]),
  // the shared MLP of shared_intermediate_size packed alike (shared_mlp.input_linear, output_linear), ungated.
  // Cohere (CohereForCausalLM: Command R, Aya Expanse) and Cohere 2 (Cohere2ForCausalLM: Command R7B, Command A):
  // every norm a LayerNorm without bias (its mean taken out, in float32, its weight in float32; eps layer_norm_eps:
  // layer_norm), one a layer, whose output feeds the attention and the MLP alike, both added to the residual stream
  // (parallel); each head's rotated pairs interleaved; the logits times logit_scale. Cohere 2's sliding layers
  // (layer_types, else every sliding_window_pattern-th layer full) rotate and its full ones rotate nothing; every
  // Cohere layer rotates (its use_qk_norm refused).
  bool cohere() const { return architecture == "CohereForCausalLM" || cohere2(); }
  bool cohere2() const { return architecture == "Cohere2ForCausalLM"; }
  bool layer_norm = false, parallel = false;
  // Llama 4 (Llama4ForCausalLM; Llama4ForConditionalGeneration's language model: Llama-4-Scout / Maverick): each head's
  // rotated pairs interleaved; its NoPE layers (no_rope_layers' zeros, else every no_rope_layer_interval-th) rotate
  // nothing, their queries times 1 + attn_scale ln(1 + floor((position + 1) / floor_scale)) (attn_temperature_tuning:
  // query_scale_beta / length / offset, on the NoPE layers only); the other layers' q and k L2-normed after RoPE
  // (use_qk_norm: a weightless RMSNorm) and their attention chunked (a query sees the keys of its own chunk of
  // attention_chunk_size positions of its document: layer_types "chunked_attention"); MoE layers (moe_layers, else
  // every interleave_moe_layer_step-th) route each token to its top num_experts_per_tok experts by logit, each expert's
  // input times the sigmoid of its logit (router_scales_input), plus a shared expert, all of intermediate_size
  // (feed_forward.experts.gate_up_proj [E, H, gate | up], down_proj [E, I, H]); dense layers intermediate_size_mlp.
  bool llama4() const {
    return architecture == "Llama4ForCausalLM" || architecture == "Llama4ForConditionalGeneration";
  }
  int64_t chunk = 0;             // attention_chunk_size (0: no chunked layers)
  std::vector<uint8_t> chunked;  // per layer (empty: none)
  bool chunked_layer(int64_t layer) const {
    return chunk > 0 && !chunked.empty() && chunked[static_cast<size_t>(layer)];
  }
  bool router_scales_input = false, query_scale_nope_only = false;
  double query_scale_offset = 0;
  // Arcee (ArceeForCausalLM: AFM-4.5B): Llama's layers with an ungated MLP, down(relu(up(h))^2) (relu2_mlp; its
  // hidden_act "relu2").
  bool arcee() const { return architecture == "ArceeForCausalLM"; }
  bool relu2_mlp = false;
  // Apertus (ApertusForCausalLM: Apertus-8B / 70B): Qwen3's per-head q / k norms, its two norms named
  // attention_layernorm and feedforward_layernorm, an ungated MLP through xIELU (xielu_mlp: each layer's learned
  // mlp.act_fn.alpha_p / alpha_n and its beta / eps; hidden_act "xielu").
  bool apertus() const { return architecture == "ApertusForCausalLM"; }
  bool xielu_mlp = false;
  bool ungated_mlp() const { return relu2_mlp || xielu_mlp; }
  // dots.llm1 (Dots1ForCausalLM: dots.llm1.base / .inst): Qwen3's attention (per-head q / k norms) with GLM-4.5's
  // experts (its sigmoid router with correction biases and groups, shared experts, the first first_k_dense_replace
  // layers dense; norm_topk_prob and first_k_dense_replace default to false and 0, as Dots1Config's); without
  // layer_types, its layers from max_window_layers on slide when sliding_window is set (no use_sliding_window key).
  bool dots1() const { return architecture == "Dots1ForCausalLM"; }
  bool granite() const { return architecture == "GraniteForCausalLM" || granite_swa() || granite_moe(); }
  // Granite SWA (GraniteSWAForCausalLM): Granite's layers and multipliers, a learned sink logit per head in every
  // attention softmax (gpt-oss's sinks), sliding layers (layer_types, else every layer but each fourth from 0) over
  // sliding_window positions, and a RoPE base per layer (layer_rope_theta; 0: no RoPE): read as one base for the full
  // layers (rope_theta) and one for the sliding ones (rope_local_theta), which is what ours runs. GraniteMoeSWA
  // (GraniteMoeSWAForCausalLM): the same attention with GraniteMoeShared's experts and shared MLP.
  bool granite_swa() const {
    return architecture == "GraniteSWAForCausalLM" || architecture == "GraniteMoeSWAForCausalLM";
  }
  bool granite_moe() const {
    return architecture == "GraniteMoeForCausalLM" || architecture == "GraniteMoeSharedForCausalLM" ||
           architecture == "GraniteMoeSWAForCausalLM" || granite_hybrid();
  }
  // Granite 4.0's hybrid kind (GraniteMoeHybridForCausalLM: Granite-4.0-H and Granite-4.0-micro): Granite's
  // multipliers, each layer's shared MLP (shared_mlp.input_linear [gate | up], output_linear;
  // shared_intermediate_size), beside GraniteMoe's experts where num_local_experts > 0, alone where it is 0;
  // position_embedding_type "rope" rotates, anything else rotates nothing. Its layer_types "mamba" (the `linear`
  // flags) mark Mamba-2 layers (transformers' GraniteMoeHybridMambaLayer, mamba2.hpp): mamba_n_heads heads of
  // mamba_d_head (mamba_expand x hidden_size in all), mamba_n_groups groups of B and C of mamba_d_state, a
  // convolution of mamba_d_conv taps (conv_kernel) with a bias where mamba_conv_bias, in_proj / out_proj biases where
  // mamba_proj_bias, dt clamped to time_step_limit; its rule run in chunks of mamba_chunk_size positions, as
  // transformers' (equal in float32 to any other chunking; the chunk the served cache keeps a row).
  bool granite_hybrid() const { return architecture == "GraniteMoeHybridForCausalLM"; }
  bool mamba2() const { return (granite_hybrid() || nemotron_h() || bamba()) && !linear.empty(); }
  // Bamba (BambaForCausalLM: Bamba-9B): Llama's layers (its MLP under feed_forward., its second norm
  // pre_ff_layernorm) with Granite 4.0-H's Mamba-2 layers but at attn_layer_indices; its attention rotates the first
  // half of each head (transformers' BambaConfig fixes partial_rotary_factor at 0.5).
  bool bamba() const { return architecture == "BambaForCausalLM"; }
  // Nemotron-H (NemotronHForCausalLM: Nemotron-H-8B / 47B / 56B, NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2): every layer one
  // block, x + mixer(norm(x)), its mixer a Mamba-2 layer ("M" in hybrid_override_pattern, "mamba" /
  // "linear_attention" in layers_block_type: the `linear` flags), attention without RoPE ("*"), or an ungated ReLU²
  // MLP ("-": mlp_blocks); tensors under backbone. (embeddings, norm_f; each layer's norm and mixer.); its RMSNorms'
  // weights applied in float32; its Mamba-2 sizes mamba_num_heads x mamba_head_dim, ssm_state_size, n_groups,
  // conv_kernel, chunk_size, use_conv_bias, in / out biases where use_bias, dt clamped below at time_step_min (what
  // transformers' NemotronHMamba2Mixer runs, whatever time_step_limit says). Its mixture-of-experts blocks ("E",
  // "moe": Nemotron 3 Nano's; moe_blocks): GLM-4.5's sigmoid router in float32 with correction biases
  // (mixer.gate.e_score_correction_bias) over n_group groups, n_routed_experts ungated ReLU² experts of
  // moe_intermediate_size (mixer.experts.up_proj / down_proj, stacked, or one expert at a time as published), their
  // weights times routed_scaling_factor, beside a shared ReLU² MLP of moe_shared_expert_intermediate_size
  // (mixer.shared_experts.); with moe_latent_size (Nemotron 3 Super's) the routed experts run in that width, between
  // mixer.fc1_latent_proj (hidden -> latent, after the router, which reads the hidden rows) and fc2_latent_proj
  // (latent -> hidden, on the experts' rounded sum), the shared MLP on the hidden rows.
  bool nemotron_h() const { return architecture == "NemotronHForCausalLM"; }
  int64_t moe_latent = 0;  // the routed experts' width where it is not the hidden size (0: the hidden size)
  std::vector<uint8_t> mlp_blocks, moe_blocks;
  bool mlp_block(int64_t layer) const { return !mlp_blocks.empty() && mlp_blocks[static_cast<size_t>(layer)]; }
  // A layer that is one block, attention or a mixer or an MLP, added to the stream alone (Nemotron-H's).
  bool single_blocks() const { return nemotron_h(); }
  int64_t mamba_heads = 0, mamba_head_dim = 0, mamba_groups = 0, mamba_state = 0, mamba_chunk = 0;
  bool mamba_conv_bias = true, mamba_proj_bias = false;
  double dt_min = 0, dt_max = std::numeric_limits<double>::infinity();  // time_step_limit
  double embed_multiplier = 1.0, residual_multiplier = 1.0, logit_scale = 1.0;
  // SmolLM3 (SmolLM3ForCausalLM): its NoPE layers (no_rope_layers' zeros, else every no_rope_layer_interval-th layer)
  // rotate nothing. Empty: every layer rotates.
  std::vector<uint8_t> nope;
  bool no_rope(int64_t layer) const { return !nope.empty() && nope[static_cast<size_t>(layer)]; }
  std::vector<int64_t> mlp_only_layers;
  bool sparse(int64_t layer) const;
  // Token ids that end a response: generation_config.json's eos_token_id when the folder has
  // one (what transformers' generate stops at), else config.json's; empty when neither says.
  std::vector<int64_t> eos;
};

extern const std::vector<std::string> kSupportedArchitectures;

// Reads and checks <folder>/config.json; throws std::runtime_error with a sentence
// naming the file, the key, the value and what is accepted.
ModelConfig read_config(const std::string& folder);

}  // namespace flashdraft::hf
