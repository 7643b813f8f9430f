"""Parity cases that do not match real TRL today: case name -> what differs and the issue tracking it.

Each listed case is marked `xfail(strict=True)`: it must keep failing, and once the trainer is fixed the test
"unexpectedly passes" and fails the run until its entry is removed here. Keep this the only place such a list lives.
Deliberate deviations (differences kept on purpose) are listed apart in `DELIBERATE_DEVIATIONS`, each with its reason
in docs/parity.md.

Descriptions give TRL's value first ("TRL vs here"). They are generated from a run (`python tests/parity/report.py
OUT_DIR --known`) and edited where the generated line does not explain the cause.
"""

KNOWN_DIVERGENCES: dict[str, str] = {
    "vlm/sft_prompt_completion_llava": "update size of the vision tower's self_attn.k_proj.bias differs (l2 1.7e-6 vs 2.7e-6): a key bias cannot change softmax attention, so its true gradient is 0 and AdamW normalises float noise (~1e-12) from a different summation order; every other tensor, the losses and the metrics match (issue 22)",
    "vlm/sft_messages_assistant_only": "update size of the vision tower's self_attn.k_proj.bias differs (l2 1.7e-6 vs 2.7e-6): a key bias cannot change softmax attention, so its true gradient is 0 and AdamW normalises float noise (~1e-12) from a different summation order; every other tensor, the losses and the metrics match (issue 22)",
    "vlm/kto_llava": "update size of the vision tower's self_attn.k_proj.bias differs (l2 1.7e-6 vs 2.7e-6): a key bias cannot change softmax attention, so its true gradient is 0 and AdamW normalises float noise (~1e-12) from a different summation order; every other tensor, the losses and the metrics match (issue 22)",
    "vlm/grpo_idefics3": "update size of the vision tower's self_attn.k_proj.bias differs (l2 1.7e-6 vs 2.7e-6): a key bias cannot change softmax attention, so its true gradient is 0 and AdamW normalises float noise (~1e-12) from a different summation order; every other tensor, the losses and the metrics match (issue 22)",
    "vlm/rloo_llava": "update size of the vision tower's self_attn.k_proj.bias differs (l2 1.7e-6 vs 2.7e-6): a key bias cannot change softmax attention, so its true gradient is 0 and AdamW normalises float noise (~1e-12) from a different summation order; every other tensor, the losses and the metrics match (issue 22)",
    "dpo/conversational_preference": "eval_rewards/chosen -0.0060579 vs -0.0060667; eval_rewards/rejected -0.01196 vs -0.011968 after the step. Float summation order: the step's loss, grad_norm and eval_before agree exactly, gradients to 1e-7, but a dozen lm_head elements whose gradient nearly cancels (|g| ~1e-9 < AdamW eps) move differently; beta*(logps - ref_logps) amplifies the 1.4e-6 logps difference. A padded batch with the LM head over every position (TRL's computation; here: packed rows, LM head on completion positions only) matches to 3e-5 (issue 18)",
    "dpo/conversational_implicit_prompt_preference": "eval_rewards/chosen -0.0060579 vs -0.0060667; eval_rewards/rejected -0.01196 vs -0.011968 after the step. Float summation order: the step's loss, grad_norm and eval_before agree exactly, gradients to 1e-7, but a dozen lm_head elements whose gradient nearly cancels (|g| ~1e-9 < AdamW eps) move differently; beta*(logps - ref_logps) amplifies the 1.4e-6 logps difference. A padded batch with the LM head over every position (TRL's computation; here: packed rows, LM head on completion positions only) matches to 3e-5 (issue 18)",
    "rloo/toy_reward": "gradients differ in 1 tensors at step 3: a near-cancelling sum (-0.0031951 vs -0.0031969, the tensor's L2 0.364 agrees to 2e-7); float noise from step 1 on, amplified by AdamW on noise-level gradient elements (issue 18)",
    "rloo/toy_reward/generation_kwargs=top_k0": "gradients differ in 1 tensors at step 3: a near-cancelling sum (-0.0031951 vs -0.0031969, the tensor's L2 0.364 agrees to 2e-7); float noise from step 1 on, amplified by AdamW on noise-level gradient elements (issue 18)",
    "xpo/max_steps=2": "step 2 (policy != reference): rewards/margins 0.00050602 vs 0.00050488 (abs diff 1.1e-6 on a difference of two ~0.01 rewards) and one near-cancelling gradient sum (0.0575667 vs 0.0575738); everything else agrees. Float summation order in the step-1 update (TRL: padded batch, LM head on every position; here: LM head on completion positions only), amplified by the cancellation (issue 18)",
    "chat_template_utils/get_training_chat_template/qwen2_5": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "chat_template_utils/get_training_chat_template/llama3": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "chat_template_utils/add_response_schema": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "gold/uld_loss/bayesian": "bayesian.loss 0.82577 vs 0.79819 on fixed tensors. TRL's merge helper (a group's last distribution times the observed probabilities of its earlier tokens) is reproduced exactly (checked on its own), but TRL's full loss with `bayesian` is not: the combination could not be inferred from outputs alone; `observed` (the default) matches (issue 20)",
    "gold/uld_loss/hybrid": "adaptive.loss 0.40327 vs 0.40335; fixed.loss 0.13487 vs 0.1349; beta=0.2.loss 0.27383 vs 0.27389 (2e-4 relative). The hybrid terms match TRL exactly on plain probability rows (adaptive weight = shared share of the teacher vocabulary, JSD on the shared entries without renormalising, ULD on the rest); on merged (multi-token) groups, whose probabilities are tiny products, TRL's log/epsilon handling differs slightly (issue 20)",
    "gold/cross_tokenizer/hybrid": "eval_loss 0.085038 vs 0.085088, loss 0.087259 vs 0.087299 (same cause as gold/uld_loss/hybrid); matched_loss 0.0981 vs 0.0895 and unmatched_loss 0.008 vs 0.0073: here the mean over sequences of each term (the terms the loss weights), TRL's metrics average them another way (issue 20)",
    "gold/cross_tokenizer/grad_accum": "step 1 matches; at step 2 grad_norm 0.10635 vs 0.10712 and total_flos 7.3477e+09 vs 3.2767e+09: TRL fetches a whole generation batch (per_device_train_batch_size * gradient_accumulation_steps prompts) at once and slices it, padded to the longest row of the generation batch, so the second step's micro-batches are padded (and counted) differently (issue 20)",
    "gold/num_generations/grad_accum": "grad_norm 0.0071783 vs 0.014357, loss 0.016445 vs 0.03289 (TRL half): "
    "not from num_generations — with num_generations=1, lmbda=1 and gradient_accumulation_steps=2 the JSD path "
    "differs by the same factor 2 (TRL fetches and slices a whole generation batch per optimizer step, see "
    "gold/cross_tokenizer/grad_accum); with gradient_accumulation_steps=1 gold/num_generations matches (issue 20)",
    "gold/columns": "TRL tokenizes the dataset up front (columns messages, original_prompt_text, original_completion_text, input_ids, attention_mask, byte_offsets, completion_mask); here the GKD collator tokenizes raw rows (column messages) and adds the texts and byte offsets to each batch (issue 20)",
}

# Differences kept on purpose (reason in docs/parity.md); also strict xfail, so a change of mind shows up.
DELIBERATE_DEVIATIONS: dict[str, str] = {
    "dataclasses/DPOConfig": "two fields TRL 1.16 does not have: model_adapter_name, ref_adapter_name (TRL 0.x had "
    "them; they select the trained and the reference adapter of a multi-adapter PEFT model, None is TRL's behaviour)",
    "dataclasses/vllm_serve.ScriptArguments": "vllm-serve --host defaults to 127.0.0.1 (TRL: 0.0.0.0): the weight-sync "
    "endpoints are not reachable from the network unless asked (issue 26)",
    "cpo/max_length=14": "two training prompts are 14 tokens long: TRL keeps those pairs with empty completions "
    "(log-prob 0, NaN for the length-normalised losses), here they are dropped with a warning, so the step and the "
    "evaluation after it differ (eval_logps/chosen -28.762 vs -28.808); the evaluation before it matches (issue 19)",
    "gold/errors/hybrid_weights_without_hybrid": "uld_hybrid_matched_weight / uld_hybrid_unmatched_weight set "
    "without uld_use_hybrid_loss=True raise a ValueError (TRL ignores them silently)",
    "deviations/bf16_default_on_cpu": "bf16=None resolves to fp32 on a CPU-only machine (TRL: ValueError without "
    "use_cpu, bf16 autocast with use_cpu=True)",
}
