"""Validation's drafts from an eval_blocks dump (tests/tools/eval_blocks.cpp), grouped by row.

The engine's drafts (core/include/flashdraft/model.hpp, Drafts) are a flat list: draft d
continues row draft_rows[d] after position draft_starts[d], with the drafted tokens
draft_tokens[d] for the positions after it and their labels draft_labels[d]. The checks here
walk a row's drafts next to a reference computed on that row, so `by_row` lays them out per
row, in the order the drafter gave them, padded to the most drafts of any row:

  anchors [R, N]                 the draft's start (0 in padding)
  block_valid [R, N] bool        a real draft (False: padding)
  predictions [R, N, K + 1]      column 0 the token at the start, then the drafted tokens
  labels [R, N, K + 1]           column 0 -1, then the labels (-1 = none; padding all -1)
  verified [R, N, K + 1]         the target's labels likewise, where the dump has them
"""
import torch


def by_row(dump):
    """The dump with the per-row view above added (its other entries unchanged)."""
    tokens, rows, starts = dump["tokens"], dump["draft_rows"], dump["draft_starts"]
    drafted, labels = dump["draft_tokens"], dump["draft_labels"]
    R, K = tokens.shape[0], drafted.shape[1]
    slot = torch.zeros_like(rows)
    count = torch.zeros(R, dtype=torch.long)
    for d, r in enumerate(rows.tolist()):
        slot[d] = count[r]
        count[r] += 1
    N = max(int(count.max()), 1) if R else 1
    out = dict(dump)
    out["anchors"] = torch.zeros(R, N, dtype=torch.long)
    out["block_valid"] = torch.zeros(R, N, dtype=torch.bool)
    out["predictions"] = torch.full((R, N, K + 1), -1, dtype=torch.long)
    out["labels"] = torch.full((R, N, K + 1), -1, dtype=torch.long)
    out["anchors"][rows, slot] = starts
    out["block_valid"][rows, slot] = True
    out["predictions"][rows, slot, 0] = tokens[rows, starts]
    out["predictions"][rows, slot, 1:] = drafted
    out["labels"][rows, slot, 1:] = labels
    if "verified" in dump:
        out["verified"] = torch.full((R, N, K + 1), -1, dtype=torch.long)
        out["verified"][rows, slot, 1:] = dump["verified"]
    return out
