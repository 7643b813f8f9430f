"""Parity cases that do not match real TRL today: case name -> what differs and the issue tracking it.

Each listed case is marked `xfail(strict=True)`: it must keep failing, and once the trainer is fixed the test
"unexpectedly passes" and fails the run until its entry is removed here. Keep this the only place such a list lives.
Deliberate deviations (differences kept on purpose) are listed apart in `DELIBERATE_DEVIATIONS`, each with its reason
in docs/parity.md.

Descriptions give TRL's value first ("TRL vs here"). They are generated from a run (`python tests/parity/report.py
OUT_DIR --known`) and edited where the generated line does not explain the cause.
"""

KNOWN_DIVERGENCES: dict[str, str] = {
    "dpo/loss_type=sigmoid": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=hinge": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=ipo": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=exo_pair": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=nca_pair": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=robust": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=bco_pair": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=sppo_hard": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=aot": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=aot_unpaired": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=apo_zero": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=apo_down": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=discopop": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=sft": "evaluate() adds eval_model_preparation_time; log_history adds eval_model_preparation_time; eval_logits/chosen -0.012899 vs -0.012997; eval_logits/rejected -0.011346 vs -0.011696; eval_logps/chosen -32.552 vs -32.512; eval_logps/rejected -36.744 vs -36.718 +31 more (issue 18)",
    "dpo/loss_type=sigmoid_norm": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/loss_type=sigmoid+sft": "eval_logits/chosen -0.014079 vs -0.014786; eval_logits/rejected -0.011842 vs -0.012456; eval_logps/chosen -32.771 vs -32.733; eval_logps/rejected -36.955 vs -36.917 +21 more (issue 18)",
    "dpo/loss_type=sigmoid+bco_pair+sft": "eval_logits/chosen -0.013787 vs -0.01449; eval_logits/rejected -0.011615 vs -0.012392; eval_logps/chosen -32.686 vs -32.648; eval_logps/rejected -36.871 vs -36.838 +21 more (issue 18)",
    "dpo/f_divergence_type=forward_kl": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/f_divergence_type=js_divergence": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/f_divergence_type=alpha_divergence": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/conversational_preference": "eval_rewards/chosen -0.0060579 vs -0.0060667; eval_rewards/rejected -0.01196 vs -0.011968; eval_rewards/chosen -0.0060579 vs -0.0060667; eval_rewards/rejected -0.01196 vs -0.011968 +1 more (issue 18)",
    "dpo/standard_implicit_prompt_preference": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/conversational_implicit_prompt_preference": "eval_rewards/chosen -0.0060579 vs -0.0060667; eval_rewards/rejected -0.01196 vs -0.011968; eval_rewards/chosen -0.0060579 vs -0.0060667; eval_rewards/rejected -0.01196 vs -0.011968 +1 more (issue 18)",
    "dpo/use_weighting=True": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/ld_alpha=0.5": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/beta=0.5": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/precompute_ref_log_probs=True": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/max_length=8": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/gradient_accumulation_steps=2": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/llama": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "dpo/peft_lora": "prepared columns: TRL also has chosen, prompt, rejected (issue 18)",
    "reward/standard_preference": "prepared columns: TRL also has chosen, chosen_ids, prompt, rejected, rejected_ids; here also chosen_input_ids, rejected_input_ids (issue 18)",
    "reward/center_rewards_coefficient=0.01": "prepared columns: TRL also has chosen, chosen_ids, prompt, rejected, rejected_ids; here also chosen_input_ids, rejected_input_ids (issue 18)",
    "reward/conversational_preference": "prepared columns: TRL also has chosen, chosen_ids, prompt, rejected, rejected_ids; here also chosen_input_ids, rejected_input_ids (issue 18)",
    "reward/standard_implicit_prompt_preference": "prepared columns: TRL also has chosen, chosen_ids, rejected, rejected_ids; here also chosen_input_ids, rejected_input_ids (issue 18)",
    "reward/margin": "prepared columns: TRL also has chosen, chosen_ids, prompt, rejected, rejected_ids; here also chosen_input_ids, rejected_input_ids (issue 18)",
    "reward/llama": "prepared columns: TRL also has chosen, chosen_ids, prompt, rejected, rejected_ids; here also chosen_input_ids, rejected_input_ids (issue 18)",
    "kto/loss_type=kto": "evaluate() adds eval_count/chosen, eval_count/rejected, eval_logits/chosen_sum, eval_logits/rejected_sum +4 more; log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected_sum +12 more; eval_logits/chosen 0.012423 vs 0.014217; eval_logits/rejected 0.010622 vs 0.012527; eval_logps/chosen -34.179 vs -35.911; eval_logps/rejected -49.071 vs -48.518 +17 more (issue 18)",
    "kto/loss_type=apo_zero_unpaired": "evaluate() adds eval_count/chosen, eval_count/rejected, eval_logits/chosen_sum, eval_logits/rejected_sum +4 more; log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected_sum +12 more; eval_logits/chosen 0.012423 vs 0.014217; eval_logits/rejected 0.010622 vs 0.012527; eval_logps/chosen -34.179 vs -35.911; eval_logps/rejected -49.071 vs -48.518 +16 more (issue 18)",
    "kto/conversational_unpaired_preference": "evaluate() adds eval_count/chosen, eval_count/rejected, eval_logits/chosen_sum, eval_logits/rejected_sum +4 more; log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected_sum +12 more; eval_kl 0 vs 0.035075; eval_logits/chosen -0.00071216 vs -0.00024824; eval_logits/rejected -0.0040841 vs -0.0038535; eval_logps/chosen -76.872 vs -82.121 +20 more (issue 18)",
    "kto/paired_standard_preference": "evaluate() adds eval_count/chosen, eval_count/rejected, eval_logits/chosen_sum, eval_logits/rejected_sum +5 more; log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected +17 more; eval_kl 0.71146 vs 0.085571; eval_logits/chosen -0.012118 vs 0.00060193; eval_logits/rejected -0.01096 vs 0.0014361; eval_logps/chosen -32.635 vs -33.587 +21 more (issue 18)",
    "kto/desirable_weight=1.2": "evaluate() adds eval_count/chosen, eval_count/rejected, eval_logits/chosen_sum, eval_logits/rejected_sum +4 more; log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected_sum +12 more; eval_logits/chosen 0.0097093 vs 0.011289; eval_logits/rejected 0.0087234 vs 0.010217; eval_logps/chosen -34.141 vs -35.871; eval_logps/rejected -49.024 vs -48.466 +17 more (issue 18)",
    "kto/precompute_ref_log_probs=True": "evaluate() adds eval_count/chosen, eval_count/rejected, eval_logits/chosen_sum, eval_logits/rejected_sum +4 more; log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected_sum +12 more; eval_logits/chosen 0.012423 vs 0.014217; eval_logits/rejected 0.010622 vs 0.012527; eval_logps/chosen -34.179 vs -35.911; eval_logps/rejected -49.071 vs -48.518 +17 more (issue 18)",
    "kto/llama": "evaluate() adds eval_count/chosen, eval_count/rejected, eval_logits/chosen_sum, eval_logits/rejected_sum +4 more; log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected_sum +12 more; eval_kl 0.019466 vs 0.079428; eval_logits/chosen -0.0070926 vs -0.0064729; eval_logits/rejected -0.0097939 vs -0.010695; eval_logps/chosen -67.96 vs -73.223 +21 more (issue 18)",
    "dpo/evaluate_raw_dataset": "this project raised ValueError: No columns in the dataset match the model's forward method signature: (prompt_ids, chosen_ids, rejected_ids, ref_chosen_logps, r (issue 18)",
    "reward/evaluate_raw_dataset": "this project raised ValueError: No columns in the dataset match the model's forward method signature: (chosen_input_ids, rejected_input_ids, margin). The follow (issue 18)",
    "kto/evaluate_raw_dataset": "this project raised KeyError: 'prompt_ids' (issue 18)",
    "kto/load_best_model_at_end/eval_rewards/chosen": "log_history adds count/chosen, count/rejected, logits/chosen_sum, logits/rejected_sum +12 more; best_metric -0.068609 vs -0.074291; logits/rejected -0.0003311 vs 0.00023439; eval_logits/chosen 0.012423 vs 0.014217; eval_logits/rejected 0.010622 vs 0.012527 +7 more (issue 18)",
    "grpo/num_iterations=2": "clip_ratio/high_max 0.875 vs 0.375; clip_ratio/low_min 0 vs 0.29688 (issue 18)",
    "grpo/mask_truncated_completions=True": "clip_ratio/high_max None vs 0; clip_ratio/low_min None vs 0 (issue 18)",
    "grpo/loss_type=cispo": "log_history adds clip_ratio/high_max, clip_ratio/high_mean, clip_ratio/low_mean, clip_ratio/low_min +1 more; cispo_clip_ratio 0.625 vs 1 (issue 18)",
    "grpo/loss_type=sapo": "log_history adds clip_ratio/high_max, clip_ratio/high_mean, clip_ratio/low_mean, clip_ratio/low_min +1 more (issue 18)",
    "grpo/loss_type=vespo": "log_history adds clip_ratio/high_max, clip_ratio/high_mean, clip_ratio/low_mean, clip_ratio/low_min +1 more; loss -0.01658 vs -1.4901e-08; train_loss -0.01658 vs -1.4901e-08; train_loss -0.01658 vs -1.4901e-08; training_loss -0.01658 vs -1.4901e-08 (issue 18)",
    "rloo/toy_reward": "kl 0.00425 vs 0.033999; gradients differ in 1 tensors (issue 18)",
    "rloo/toy_reward/generation_kwargs=top_k0": "kl 0.00425 vs 0.033999; gradients differ in 1 tensors (issue 18)",
    "chat_template_utils/get_training_chat_template/qwen2_5": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "chat_template_utils/get_training_chat_template/llama3": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "chat_template_utils/add_response_schema": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "chat_template_utils/parse_response": "without a response schema TRL raises AttributeError; here it falls back to the decoded text (issue 18)",
    "collators/reward/default": "this project raised KeyError: 'chosen_input_ids' (issue 18)",
    "collators/reward/margin": "this project raised KeyError: 'chosen_input_ids' (issue 18)",
}

# Differences kept on purpose (reason in docs/parity.md); also strict xfail, so a change of mind shows up.
DELIBERATE_DEVIATIONS: dict[str, str] = {
    "deviations/bf16_default_on_cpu": "bf16=None resolves to fp32 on a CPU-only machine (TRL: ValueError without "
    "use_cpu, bf16 autocast with use_cpu=True)",
}
