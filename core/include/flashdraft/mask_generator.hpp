// MaskGenerator: builds the BlockMask of one batch at the block size the chosen
// kernel asks for. Each generator also exposes its plain element predicate, the
// definition its BlockMask must reproduce exactly (tests compare the two).
#pragma once

#include <flashdraft/block_mask.hpp>
#include <flashdraft/plugin.hpp>

#include <cstdint>
#include <vector>

namespace flashdraft {

// The query blocks of the "dflash" generator (DFlash's training and served blocks, EAGLE-3's
// served chains): kv = [context (context_len) | blocks (anchors[b].size() * block_size)],
// q = the blocks. anchors[b] sorted; valid[b][n] = 0 for padding blocks.
struct MaskBlocks {
  int64_t context_len = 0;
  int64_t block_size = 0;
  std::vector<std::vector<int64_t>> anchors;
  std::vector<std::vector<uint8_t>> valid;
  // Tokens of each block, 1..block_size (empty = block_size for every block): block n
  // keeps its first lengths[b][n] keys and queries; its later queries see nothing (a
  // server's last block of a response is shorter).
  std::vector<std::vector<int64_t>> lengths;
};

// What a batch tells the generator: the shape every generator reads, the documents and
// cache offsets several read, and the block layout of the "dflash" generator, grouped.
// Generators say in their errors which fields they need; the rest of their parameters come
// from their TOML table.
struct MaskInput {
  int64_t batch = 1;
  int64_t q_len = 0;
  int64_t kv_len = 0;
  // Packed documents: per batch element, the lengths of its documents (sum = the sequence
  // length: q_len for "document" and "eagle3_ttt", blocks.context_len for "dflash").
  std::vector<std::vector<int64_t>> doc_lengths;
  // Cached decoding ("causal"): per batch element, the position of query 0 among the keys
  // (the queries are positions q_offsets[b] .. q_offsets[b] + q_len - 1 of a cache of
  // kv_len); empty = the generator's own alignment.
  std::vector<int64_t> q_offsets;
  // Sliding-window attention ("dflash": a draft layer of layer_type "sliding_attention";
  // "document" and "causal": a target's sliding layers, Mistral's and Phi-3's): > 0: a query at
  // position p sees only keys at positions p' with |p - p'| < window (before it, and after it
  // where the mask lets a query see later keys); 0 = no window.
  int64_t window = 0;
  MaskBlocks blocks;  // "dflash" only
};

class FLASHDRAFT_API MaskGenerator : public PluginObject {
 public:
  // Throws std::invalid_argument naming the bad value when the input does not fit.
  virtual BlockMask build(const MaskInput& input, int64_t block_q, int64_t block_kv) const = 0;
  // The definition, element by element (b: batch element, h: head).
  virtual bool visible(const MaskInput& input, int64_t b, int64_t h, int64_t q, int64_t kv) const = 0;
};

}  // namespace flashdraft
