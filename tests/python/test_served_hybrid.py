"""The served acceptance length with a hybrid target, Qwen3.5 (Gated DeltaNet layers between gated
attention layers), Granite 4.0-H (Mamba-2 layers beside an attention layer) and Nemotron-H (Mamba-2, MLP and attention
blocks): our served decoding keeps each
recurrent layer's state per row and rolls it back to the accepted tokens before every verification (hf target's
RecurrentCache); the reference is
z-lab's `dflash_generate` (test_served_tau.py's greedy comparison) with the target's forward computed
afresh over the whole sequence at every call, so that no state of a rejected token can remain in it.
The decoded text (the target's plain greedy text), every step's acceptance length and their mean
(tau_served, the same float) must match; and target verification's labels (tau_anchor: each draft from
the recurrent layers' state at its start) must equal transformers' greedy tokens draft by draft.

`dflash_generate` with its own cache is not that reference for a hybrid target: it rolls back with
transformers' DynamicCache.crop, which crops the attention layers' keys/values and the convolution's
inputs but leaves the recurrent state as the last verification left it, rejected tokens included
(transformers' cache_utils, LinearAttentionCacheLayerMixin.crop); its target then departs from the
target's greedy text after the first rejection. The test prints how often it does.
"""
import types

import pytest
import torch

import dflash.model as dflash_model
from test_served_tau import EOS, make_target_data, responses, reference_draft, train, validate


class Recomputed(torch.nn.Module):
    """The target as dflash_generate calls it (input_ids at position_ids, a cache it never reads), each
    call run over the whole sequence so far: the tokens before position_ids[0, 0] from the earlier
    calls (as accepted: a later call overwrites the rejected ones), then this call's."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.config = model.config
        self.lm_head = model.lm_head
        self.sequence = None

    @property
    def device(self):
        return self.model.device

    def get_input_embeddings(self):
        return self.model.get_input_embeddings()

    def forward(self, input_ids, position_ids, logits_to_keep=0, output_hidden_states=False, **_):
        start = int(position_ids[0, 0])
        self.sequence = input_ids if start == 0 else torch.cat([self.sequence[:, :start], input_ids], 1)
        out = self.model(self.sequence, output_hidden_states=output_hidden_states)
        n = input_ids.shape[1] if logits_to_keep != 1 else 1
        hidden = tuple(h[:, -input_ids.shape[1]:] for h in out.hidden_states) if output_hidden_states else None
        return types.SimpleNamespace(logits=out.logits[:, -n:], hidden_states=hidden)


class NoCache:
    """The target's cache dflash_generate makes and crops (the drafter's stays transformers')."""

    def get_seq_length(self):
        return 0

    def crop(self, _):
        pass


def reference(draft, target, prompt, new_tokens, cached):
    if cached:
        return dflash_model.dflash_generate(draft, target, torch.tensor([prompt]), max_new_tokens=new_tokens,
                                            stop_token_ids=[EOS], temperature=0.0, return_stats=True)
    make_cache = dflash_model._make_cache
    dflash_model._make_cache = lambda config: NoCache() if config is target.config else make_cache(config)
    try:
        return dflash_model.dflash_generate(draft, Recomputed(target), torch.tensor([prompt]),
                                            max_new_tokens=new_tokens, stop_token_ids=[EOS], temperature=0.0,
                                            return_stats=True)
    finally:
        dflash_model._make_cache = make_cache


def check_verification(dump, meta, target):
    """Target verification (tau_anchor) with the hybrid target: every label the engine's one forward gave (the
    target's greedy token at a drafted position, from the Gated DeltaNet's state at the draft's start and the
    drafted tokens before it) equals transformers' greedy token from a forward over the draft's document up to its
    start and the drafted tokens."""
    assert meta["tau_anchor_method"] == "target verification"
    tokens, documents, lengths = dump["tokens"], dump["documents"], dump["lengths"]
    verified, compared = dump["verified"], 0
    for d, (r, start) in enumerate(zip(dump["draft_rows"].tolist(), dump["draft_starts"].tolist())):
        ends = documents[r][documents[r] > 0].cumsum(0).tolist() or [int(lengths[r])]
        doc_start = max([0] + [e for e in ends if e <= start])
        wanted = verified[d] >= 0
        if not wanted.any():
            continue
        seq = tokens[r, doc_start:start + 1].tolist() + dump["draft_tokens"][d].tolist()
        with torch.no_grad():
            choice = target(input_ids=torch.tensor([seq])).logits[0, start - doc_start:].argmax(-1)
        K = verified.shape[1]
        assert torch.equal(verified[d][wanted], choice[:K][wanted]), (d, verified[d], choice[:K])
        compared += int(wanted.sum())
    print(f"target verification: {compared} labels of {verified.shape[0]} drafts equal transformers'; tau_anchor "
          f"{float(dump['tau_anchor']):.4f}")
    assert compared >= 200


# (family, initializer_range): Qwen3.5 at 0.07, 144 conversations: the tiny Qwen3.5's greedy text that the tiny
# drafter learns best while some responses still reach eos (measured: at 0.2 tau 1.03, at 0.1 1.02, at 0.05 1.35 but
# no response ends at eos; at 0.07 1.07 over ~1400 steps, 7 at eos). Every step that rejects a proposal rolls the
# Gated DeltaNet's state back, so the comparison holds over ~1300 rollbacks, ~100 accepted proposals. Granite 4.0-H
# (Mamba-2 layers 0, 1, 3 in chunks of 16 positions, so that a rollback lands in another chunk than the last call's
# end as often as not) at 0.07 with eos's row of the LM head scaled by 1.2: tau 3.26 over ~440 steps, 8 responses at
# eos (measured: unscaled, no response reaches eos at 0.05-0.4, tau 1.08-3.8; scaled by 1.1 none; by 1.5 40 of 47,
# ~290 steps). transformers' decoding step ignores time_step_limit where its forward applies it: the family keeps the
# default (0, inf), so that the target's greedy text (generate) is its forward's. Nemotron-H (a Mamba-2 block, an MLP
# block, attention, an MLP block) at 0.07, eos's row scaled by 1.2: tau 1.098 over ~1350 steps, 9 responses at eos.
# (Nemotron 3's kind with experts blocks, nemotron_h_moe, is not here: ours equalled dflash_generate float for float at
# every setting tried, 0.02-0.1 with eos scaled by 1.15-1.3, ~1400-1490 steps, 6-12 at eos, but the tiny drafter's tau
# stayed 1.026-1.048, under the 1.05 this test asks; its experts are the served path of test_served_moe.py's families.)
# dflash_generate with its own cache is run on the first 12 responses only, for the figure the test prints (nothing
# is asserted of it; on all 48 it was a quarter of the test's time).
CACHED_SHOWN = 12
INIT_GRANITE = 0.07
EOS_GRANITE = 1.2
INIT_NEMOTRON = 0.07
EOS_NEMOTRON = 1.2


@pytest.mark.parametrize("family,init,eos_scale", [("qwen3_5", 0.07, 1.0), ("granite4_h", INIT_GRANITE, EOS_GRANITE),
                                                   ("nemotron_h", INIT_NEMOTRON, EOS_NEMOTRON)])
def test_greedy_equals_the_reference_loop_with_a_hybrid_target(family, init, eos_scale, tmp_path_factory):
    data = make_target_data(tmp_path_factory.mktemp(f"served_{family}_target"), family, init, 144, eos_scale=eos_scale)
    trained = train("bidirectional", data, tmp_path_factory.mktemp(f"served_{family}"))
    dump, meta = validate(trained, "greedy", 0.0)
    assert meta["tau_served_method"] == "target (greedy)"
    ours = responses(dump, "served_")
    assert len(ours) >= 40, f"{len(ours)} held-out responses; at least 40 are compared"
    draft, target = reference_draft(trained["folder"]), trained["model"]
    plain_text = {tuple(prompt): response for prompt, response in trained["conversations"]}
    all_steps, stopped, cached_departs = [], 0, 0
    for i, (row, prompt_len, end, acc, generated) in enumerate(ours):
        prompt = dump["tokens"][row, :prompt_len].tolist()
        ref = reference(draft, target, prompt, end - prompt_len, cached=False)
        decoded = ref.output_ids[0, prompt_len:].tolist()
        assert decoded == plain_text[tuple(prompt)], row  # the reference decodes the target's greedy text ...
        assert generated == decoded, (row, generated, decoded)  # ... and so do we
        assert acc == ref.acceptance_lengths, (row, acc, ref.acceptance_lengths)
        all_steps += ref.acceptance_lengths
        stopped += decoded[-1] == EOS
        if i < CACHED_SHOWN:
            cached = reference(draft, target, prompt, end - prompt_len, cached=True)
            cached_departs += cached.output_ids[0, prompt_len:].tolist() != decoded
    reference_tau, ours_tau = sum(all_steps) / len(all_steps), float(dump["tau_served"])
    print(f"{family} (hybrid) greedy: {len(ours)} responses ({stopped} ended at eos), {len(all_steps)} steps; "
          f"dflash_generate (target recomputed) tau {reference_tau!r}, ours {ours_tau!r}, on the data's tokens "
          f"{float(dump['tau_served_data'])!r}; dflash_generate with its own cache departs from the target's greedy "
          f"text in {cached_departs} of the first {CACHED_SHOWN} responses")
    assert ours_tau == reference_tau
    assert float(dump["tau_served_data"]) == ours_tau  # the data is the target's greedy text
    check_verification(dump, meta, target)
    assert ours_tau > 1.05, "the trained drafter must be accepted sometimes, or the comparison proves little"
    assert stopped > 0, "some response must end at eos, so the stop rule is compared too"
    assert any(max(a) > 2 for *_, a, _ in ours), "some step must accept more than one proposal"
