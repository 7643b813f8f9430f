"""Fast paths: code that replaces a plain path of the trainers with a faster or leaner one giving the same numbers.

Each module opens with what it replaces, the predicate that decides whether it applies (a `*_fallback_reason`
function or similar: when it returns a reason, the plain path runs), the test that proves it equal to the plain
path, and its measured gain; `docs/benchmarks.md` holds the figures and the commands that reproduce them.

| module | replaces | predicate | equality test |
|---|---|---|---|
| `prefix_sharing` | scoring rows that start alike (DPO/CPO/ORPO/reward pairs, GRPO/RLOO/SDFT/SDPO groups, KTO's KL rows) whole | `supports_prefix_sharing`, `sharing_possible_now` | `tests/test_prefix_sharing.py` |
| `rollout_decode` | transformers `generate` in the online trainers | `rollout_decode_fallback_reason` | `tests/test_rollout_decode.py` |
| `small_row_linear` | `x @ Wᵀ` for the few rows of a CPU decode step (`W @ xᵀ` instead; logits equal to float rounding) | `small_row_linear_fallback_reason` | `tests/test_small_row_linear.py` |
| `last_layer_selection` | the last decoder layer at every position when few are read | `last_layer_selection_fallback_reason` | `tests/test_last_layer_selection.py` |
| `fused_lm_head` | full `batch x seq x vocab` logits when only label log-probs are needed | `fusable_lm_head` | `tests/test_fused_lm_head.py` |
| `layer_checkpoints` | transformers' gradient checkpoint of a decoder layer (CPU, one process); the last layers kept uncheckpointed within the gradient budget (`LayerBudget`) | `layer_checkpoint_fallback_reason`, `LayerBudget.plan` | `tests/test_layer_checkpoints.py` |
| `lean_modules` | module-call overhead of norms/MLPs in training | `lean_modules` (context manager checks) | `tests/test_training_kernels.py` |
| `tied_embedding_grad` | the dense `vocab x hidden` gradient of tied input embeddings, added to the head's | `tied_embedding_grad_fallback_reason` | `tests/test_tied_embedding_grad.py` |
| `reference_cache` | repeating a frozen reference's pass for examples seen before | `ReferenceCache` (frozen reference only) | `tests/test_reference_cache.py` |
| `optimizer_in_backward` | the optimizer step after the backward pass, with every gradient held at once (without clipping; with it, two backward passes in the online trainers) | `optimizer_in_backward_fallback_reason` | `tests/test_optimizer_in_backward.py` |
| `cpu_allocator` | glibc's dynamic mmap/trim thresholds during CPU training | `activation_memory_fallback_reason` | `tests/test_cpu_allocator.py` |

The fast paths that lay a batch out or run a forward otherwise than the plain path (padding dropped, prefixes shared,
prompts prefilled once, the rollout loop, the reference's pass order, the reference cache, KTO's KL continuation)
also step aside when the forward draws random numbers
([`~trl.trainer.utils.forward_randomness.forward_is_deterministic`]: dropout in train mode, NEFTune's noise).

Packed attention (`trl.kernels.packed_attention`, applied by `trl.trainer.utils.packing.packed_sdpa_attention`) and
the chunked log-softmax kernels (`trl.kernels`) are the kernels several of these build on.
"""
