"""Parity cases that do not match real TRL today: case name -> what differs and the issue tracking it.

Each listed case is marked `xfail(strict=True)`: it must keep failing, and once the trainer is fixed the test
"unexpectedly passes" and fails the run until its entry is removed here. Keep this the only place such a list lives.
Deliberate deviations (differences kept on purpose) are listed apart in `DELIBERATE_DEVIATIONS`, each with its reason
in docs/parity.md.

Descriptions give TRL's value first ("TRL vs here"). They are generated from a run (`python tests/parity/report.py
OUT_DIR --known`) and edited where the generated line does not explain the cause.
"""

KNOWN_DIVERGENCES: dict[str, str] = {
    "chat_template_utils/get_training_chat_template/qwen2_5": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "chat_template_utils/get_training_chat_template/llama3": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "chat_template_utils/add_response_schema": "TRL raises ValueError on the tiny tokenizers (their templates are not the hub's byte for byte, see docs/parity.md); here the template is recognised (issue 18)",
    "gspo_token/sequence_token/beta=0.04": "step 2 (second iteration on the same rollouts) loss -0.15651 vs -0.15669, "
    "grad_norm 0.38992 vs 0.38743; step 1 agrees; kl 0.061057 vs 0.056332 (1.12 logs the plain KL, 1.16 and this project weight it by the importance ratio). Not GSPO-token's ratio: importance_sampling_level "
    "token and sequence give the same gap against TRL 1.12 with beta=0.04 and num_iterations=2 (and without beta "
    "GSPO-token matches); the GRPO base's KL term under num_iterations=2 differs from 1.12's (against 1.16 both the loss "
    "and the logged kl match: parity grpo/num_iterations=2/beta=0.04) (issue 24)",
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
    "errors/kto_loss_type_unknown": "KTOConfig(loss_type='sigmoid') raises ValueError naming the accepted loss types; "
    "TRL accepts it and crashes in the loss (UnboundLocalError: 'chosen_losses')",
    "deviations/bf16_default_on_cpu": "bf16=None without use_cpu resolves to fp32 on a CPU-only machine (TRL: "
    "ValueError, 'Your setup doesn't support bf16/gpu')",
    "sdft/steps_per_generation=2": "the completions of one prompt run that prompt once (prefix sharing), student "
    "and teacher: logits equal to float rounding, not bit for bit; two AdamW steps at lr 1e-2 amplify that rounding "
    "past the gradient fingerprints' tolerance at step 3 (embed_tokens.weight.sum -0.00068918 vs -0.00069147, 1e-4 "
    "of its l2 allowed); steps 1 and 2, and every other SDFT and SDPO case, match",
    "ppo/max_grad_norm_set": "a max_grad_norm the user sets clips PPO's gradients; TRL 1.12's PPO ignores the field, "
    "so updates whose norm exceeds it differ (loss/value_avg 0.038326 vs 0.03692 at step 1). Left unset, neither "
    "clips and every PPO case matches",
}
