// A hidden-state cache (the hf target's [target] hidden_cache, the cache target's path): the target's states of every
// conversation, computed once elsewhere (scripts/dump-hidden-states: transformers over one or more GPUs, for a target
// too large to run beside the drafter) and read back for each document of a batch instead of running the decoder.
//
// Format "flashdraft-hidden-v1": a folder of hidden-*.safetensors files (read in name order), each with
//   tokens  I32 [T]        the conversations' token ids, concatenated
//   offsets I64 [n + 1]    conversation i spans rows offsets[i] .. offsets[i + 1] (0 first, T last, increasing)
//   hidden  BF16/F16/F32 [T, E, H]   the states after layers E (as the hf target numbers them: layer L is the output
//                          of decoder layer L, after the final norm for the last one)
// and metadata format, layers ("0,2,3"), hidden_size, num_hidden_layers, architecture and model (the checkpoint).
// A document of a batch is found by its tokens: the cached conversation with exactly its tokens, or one that begins
// with them (a conversation cut at seq_len; its states there are the same: the model is causal). Only the tokens are
// held in memory (4 bytes a token); the states are read from the memory-mapped files as documents ask for them.
#pragma once

#include <flashdraft/export.hpp>
#include <flashdraft/model.hpp>
#include <flashdraft/safetensors.hpp>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace flashdraft {

class FLASHDRAFT_API HiddenCache {
 public:
  // Opens and checks every file of `folder` against the model (hidden size, layer count); a bad one is refused with a
  // sentence naming the file (std::runtime_error).
  HiddenCache(const std::string& folder, int64_t hidden_size, int64_t model_layers);
  const std::vector<int64_t>& layers() const { return layers_; }
  const std::string& folder() const { return folder_; }
  int64_t conversations() const { return static_cast<int64_t>(entries_.size()); }
  int64_t tokens() const { return tokens_; }
  std::string describe() const;  // "FOLDER (n conversations, T tokens, layers 0,2,3, bf16, from MODEL)"

  // The states of the document with tokens[0 .. length) at the layers `columns` (indices into layers()),
  // [length, columns, H] on `device` in `dtype`; throws std::runtime_error naming the document when no cached
  // conversation begins with its tokens.
  at::Tensor document(const int64_t* tokens, int64_t length, const std::vector<int64_t>& columns, c10::Device device,
                      c10::ScalarType dtype);
  // Every document of a batch (row_documents(): padded, packed or cut rows), [B, S, columns, H] with zeros past each
  // row's documents.
  at::Tensor batch(const Batch& batch, const std::vector<int64_t>& columns, c10::Device device, c10::ScalarType dtype);
  // The first document of the batch the cache does not hold, described ("" = it holds them all). Reads no state.
  std::string missing(const Batch& batch);
  // The column of layer id `layer` in the cache, -1 where it holds none.
  int64_t column(int64_t layer) const;

 private:
  struct Entry {
    int32_t shard;
    int64_t begin, length;  // rows of the shard
  };
  struct Shard {
    std::unique_ptr<safetensors::File> file;
    std::vector<int32_t> tokens;
  };
  std::string folder_, dtype_, model_;
  std::vector<int64_t> layers_;
  std::vector<Shard> shards_;
  std::vector<Entry> entries_;
  int64_t tokens_ = 0;
  std::unordered_multimap<uint64_t, size_t> whole_;                      // hash of all its tokens -> entry
  std::map<int64_t, std::unordered_multimap<uint64_t, size_t>> prefix_;  // per length L: hash of its first L tokens

  const Entry* find(const int64_t* tokens, int64_t length);
  std::string not_held(const int64_t* tokens, int64_t length) const;
  bool begins_with(const Entry& e, const int64_t* tokens, int64_t length) const;
};

}  // namespace flashdraft
