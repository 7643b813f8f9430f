"""Generation throughput for the online trainers: transformers `generate` vs vLLM, on CPU or GPU.

Each configuration runs in its own subprocess; memory is the resident size of that process and its children (the
vLLM engine and server processes) at the end of the run. The vLLM configurations run
with the vLLM environment's interpreter (`make vllm-env` builds `.venv-vllm`; pass `--vllm-python` otherwise):

- `hf`: `model.generate` on left-padded batches;
- `hf-groups` / `loop`: the online trainers' transformers path without `use_vllm`: each group of `--n` rows shares
  one prompt prefill, then `generate` (`hf-groups`, `generate_with_shared_prompts`) or the rollout decode loop
  (`loop`, `trl/trainer/fast_paths/rollout_decode.py`, the same tokens); no end token, so every row runs to the end;
- `vllm`: an in-process `vllm.LLM` (what colocate mode runs);
- `vllm-serve` (with `--server`): `trl vllm-serve` queried through `VLLMClient` (server mode), start-up excluded.

Every completion is exactly `--max-new-tokens` long (EOS ignored) so that the configurations do the same work.

With `--trainer`, two more configurations time whole GRPO steps (generation, rewards, log-probs, optimizer step) in
the vLLM environment: `grpo-hf` (transformers generation) and `grpo-vllm` (`use_vllm=True, vllm_mode="colocate"`,
weights pushed into the in-process engine after every step). Each step generates `--num-prompts * --n` completions
of `--max-new-tokens` tokens; the first step (warm-up, first weight push) is left out of the mean.

Usage:
    python benchmarks/bench_generation.py                         # ~30M model, 64 completions of 64 tokens
    python benchmarks/bench_generation.py --model tiny --server   # tiny model, also through the HTTP server
    python benchmarks/bench_generation.py --trainer               # also GRPO step time, HF generate vs colocate
    python benchmarks/bench_generation.py --only hf-groups,loop --num-prompts 2 --prompt-length 80 \
        --max-new-tokens 32 --repeats 5                           # the GRPO benchmark's rollout, no vLLM
"""

import argparse
import os
import socket
import subprocess
import sys
import time

import _harness


MODELS = _harness.MODELS
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prompts(num_prompts: int, prompt_length: int, vocab_size: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(10, vocab_size - 10) for _ in range(prompt_length)] for _ in range(num_prompts)]


def _total_rss_mb() -> float:
    """Resident memory of this process and all its descendants (vLLM runs its engine in child processes)."""
    import psutil

    process = psutil.Process()
    total = process.memory_info().rss
    for child in process.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def run_hf(model_path: str, prompts: list[list[int]], n: int, max_new_tokens: int, batch_size: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    expanded = [p for p in prompts for _ in range(n)]

    def generate(batch):
        input_ids = torch.tensor(batch)  # equal-length prompts: no padding needed
        with torch.no_grad():
            return model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=1.0,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                pad_token_id=model.config.pad_token_id or 0,
            )

    generate(expanded[:2])  # warm-up
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(expanded), batch_size):
        out = generate(expanded[i : i + batch_size])
        tokens += (out.shape[1] - len(expanded[0])) * out.shape[0]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "completions": len(expanded), "tokens": tokens, "rss_mb": _total_rss_mb()}


def run_rollouts(
    model_path: str, prompts: list[list[int]], n: int, max_new_tokens: int, loop: bool, repeats: int
) -> dict:
    """Grouped rollouts as the online trainers run them: `generate_with_shared_prompts` with or without the loop;
    the fastest of `repeats` runs."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from trl.trainer.online_generation import generate_with_shared_prompts

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=True, top_k=0, pad_token_id=0)
    ids = torch.tensor(prompts)  # equal-length prompts: no padding needed
    rows = torch.arange(len(prompts)).repeat_interleave(n)

    def generate(prompt_ids, row_to_prompt):
        return generate_with_shared_prompts(
            model, prompt_ids, torch.ones_like(prompt_ids), row_to_prompt, config, rollout_decode=loop
        )

    generate(ids[:1], rows[:2] * 0)  # warm-up
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = generate(ids, rows)
        seconds = min(seconds, time.perf_counter() - start)
    tokens = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return {"seconds": seconds, "completions": out.shape[0], "tokens": tokens, "rss_mb": _total_rss_mb()}


def run_vllm(model_path: str, prompts: list[list[int]], n: int, max_new_tokens: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams

    kwargs = {} if torch.cuda.is_available() else {"gpu_memory_utilization": 0.2}
    llm = LLM(model=model_path, dtype="float32", max_model_len=512, seed=0, **kwargs)
    params = SamplingParams(n=n, temperature=1.0, max_tokens=max_new_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    completions = [c for o in outputs for c in o.outputs]
    tokens = sum(len(c.token_ids) for c in completions)
    return {"seconds": seconds, "completions": len(completions), "tokens": tokens, "rss_mb": _total_rss_mb()}


def run_vllm_serve(model_path: str, prompts: list[list[int]], n: int, max_new_tokens: int) -> dict:
    import torch

    from trl.generation.vllm_client import VLLMClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "trl.cli.main", "vllm-serve", "--model", model_path, "--port", str(port)]
    command += ["--dtype", "float32", "--max_model_len", "512", "--log_level", "warning"]
    if not torch.cuda.is_available():
        command += ["--gpu_memory_utilization", "0.2"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = VLLMClient(host="127.0.0.1", server_port=port, connection_timeout=600)
        client.generate([prompts[0]], max_tokens=4)  # warm-up
        start = time.perf_counter()
        out = client.generate(
            prompts, n=n, temperature=1.0, max_tokens=max_new_tokens, generation_kwargs={"ignore_eos": True}
        )
        seconds = time.perf_counter() - start
        rss_mb = _total_rss_mb()  # the server and its engines are children of this process
    finally:
        server.terminate()
        server.wait(timeout=120)
    ids = out["completion_ids"]
    return {"seconds": seconds, "completions": len(ids), "tokens": sum(len(c) for c in ids), "rss_mb": rss_mb}


def run_grpo(model_path: str, num_prompts: int, n: int, max_new_tokens: int, use_vllm: bool, steps: int) -> dict:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from trl import GRPOConfig, GRPOTrainer
    from trl.assets import load_test_dataset

    def reward(completion_ids, **kwargs):
        return [sum(t % 2 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    # Every completion exactly max_new_tokens long, in both back-ends (their option names differ).
    forced_length = {"min_tokens": max_new_tokens} if use_vllm else {"min_new_tokens": max_new_tokens}
    args = GRPOConfig(
        **_harness.training_kwargs(
            os.path.join("/tmp", f"bench_generation_grpo_{os.getpid()}"), steps, num_prompts * n, logging_steps=1
        ),
        num_generations=n,
        max_completion_length=max_new_tokens,
        generation_kwargs=forced_length,
        learning_rate=1e-6,
        seed=0,
        use_vllm=use_vllm,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.2,
        vllm_max_model_length=512,
    )
    # Process CPU time of each step (all threads, vLLM's included): steadier than wall time on a busy machine.
    clock = _harness.step_timer(time.process_time)
    dataset = load_test_dataset("standard_prompt_only", split="train")
    trainer = GRPOTrainer(model_path, reward_funcs=reward, args=args, train_dataset=dataset, callbacks=[clock])
    trainer.train()
    logs = [log for log in trainer.state.log_history if "step_time" in log][1:]  # first step: warm-up
    seconds = sum(log["step_time"] for log in logs) / len(logs)
    generation = sum(log["timing/generation"] for log in logs) / len(logs)
    completions = num_prompts * n
    result = {
        "seconds": seconds,
        "cpu_seconds": sum(clock.times[1:]) / len(clock.times[1:]),
        "generation_seconds": generation,
        "completions": completions,
        "tokens": completions * max_new_tokens,
        "rss_mb": _total_rss_mb(),
    }
    trainer.end()
    return result


def worker(args: argparse.Namespace) -> None:
    _harness.setup_offline(quiet=False)
    from transformers import AutoConfig

    from trl.assets import get_model_path

    model_path = get_model_path(MODELS[args.model])
    vocab_size = AutoConfig.from_pretrained(model_path).vocab_size
    prompts = _prompts(args.num_prompts, args.prompt_length, vocab_size)
    if args.worker == "hf":
        result = run_hf(model_path, prompts, args.n, args.max_new_tokens, args.hf_batch_size)
    elif args.worker in ("hf-groups", "loop"):
        result = run_rollouts(model_path, prompts, args.n, args.max_new_tokens, args.worker == "loop", args.repeats)
    elif args.worker == "vllm":
        result = run_vllm(model_path, prompts, args.n, args.max_new_tokens)
    elif args.worker in ("grpo-hf", "grpo-vllm"):
        use_vllm = args.worker == "grpo-vllm"
        result = run_grpo(model_path, args.num_prompts, args.n, args.max_new_tokens, use_vllm, args.steps)
    else:
        result = run_vllm_serve(model_path, prompts, args.n, args.max_new_tokens)
    _harness.print_result(result, marker="RESULT ")


def main() -> None:
    parser = _harness.make_parser(__doc__)
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--server", action="store_true", help="also measure `trl vllm-serve` through VLLMClient")
    parser.add_argument("--trainer", action="store_true", help="also time GRPO steps: HF generate vs colocate")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps with --trainer (the first is warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="rollouts timed per configuration (fastest kept)")
    parser.add_argument("--only", help="comma-separated configurations to run (default: all)")
    parser.add_argument("--vllm-python", default=os.path.join(ROOT, ".venv-vllm", "bin", "python"))
    parser.add_argument(
        "--worker",
        choices=["hf", "hf-groups", "loop", "vllm", "vllm-serve", "grpo-hf", "grpo-vllm"],
        help=argparse.SUPPRESS,
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    keys = ["model", "num_prompts", "n", "prompt_length", "max_new_tokens", "hf_batch_size", "steps", "repeats"]
    forwarded = _harness.forwarded_flags(args, keys, dashes=True)
    vllm_python = args.vllm_python if os.path.exists(args.vllm_python) else sys.executable
    configurations = [(name, sys.executable) for name in ("hf", "hf-groups", "loop")]
    configurations.append(("vllm", vllm_python))
    if args.server:
        configurations.append(("vllm-serve", vllm_python))
    if args.trainer:  # both in the vLLM environment: same library versions for the comparison
        configurations += [("grpo-hf", vllm_python), ("grpo-vllm", vllm_python)]
    if args.only:
        configurations = [(name, python) for name, python in configurations if name in args.only.split(",")]
    print(
        f"model={MODELS[args.model]} prompts={args.num_prompts} n={args.n} prompt_length={args.prompt_length} "
        f"max_new_tokens={args.max_new_tokens}"
    )
    print(f"{'backend':<12}{'seconds':>10}{'completions/s':>16}{'tokens/s':>12}{'RSS MB (all processes)':>24}")
    for name, python in configurations:
        try:
            r = _harness.run_child(__file__, ["--worker", name, *forwarded], python=python, marker="RESULT ")
        except _harness.ChildFailed as error:
            print(f"{name:<12} failed:\n{error.stderr[-2000:]}")
            continue
        print(
            f"{name:<12}{r['seconds']:>10.2f}{r['completions'] / r['seconds']:>16.2f}"
            f"{r['tokens'] / r['seconds']:>12.1f}{r['rss_mb']:>24.0f}"
        )
        if "generation_seconds" in r:
            print(
                f"{'':<12}(per GRPO step: generation {r['generation_seconds']:.2f} s of wall time; "
                f"{r['cpu_seconds']:.2f} s of process CPU time)"
            )


if __name__ == "__main__":
    main()
