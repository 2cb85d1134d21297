"""Patch a transformers MoE model, compile it, generate, and compare tokens/s with the original.

    python examples/hf_generate.py --family deepseek_v3            # small random model
    python examples/hf_generate.py --model /path/to/Qwen3-30B-A3B --device cuda

Without ``--model`` the model is built from its config class with random
weights (a few layers, small sizes), so it runs anywhere in seconds.
"""

from __future__ import annotations

import argparse
import os

import torch
import transformers
from timing import call_ms, summary

import torch_moe_ops as tmo
from torch_moe_ops import hf

FAMILY_NAMES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss")


def small_config(family: str, layers: int) -> transformers.PretrainedConfig:
    """A small random-weight config of ``family``: 256 hidden, 16 experts, top-4."""
    common = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                  num_experts_per_tok=4, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=256, num_local_experts=16)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, intermediate_size=512,
                                           moe_intermediate_size=128,
                                           shared_expert_intermediate_size=256, num_experts=16)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, intermediate_size=512,
                                           moe_intermediate_size=128, num_experts=16,
                                           norm_topk_prob=True, head_dim=64)
    if family == "olmoe":
        return transformers.OlmoeConfig(**common, intermediate_size=128, num_experts=16)
    if family == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, intermediate_size=512, moe_intermediate_size=128, n_routed_experts=16,
            n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=32, qk_nope_head_dim=32,
            v_head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.GptOssConfig(**common, intermediate_size=256, num_local_experts=16,
                                     head_dim=64, sliding_window=128)


def checkpoint_problem(path: str) -> str | None:
    """Why ``path`` is not a local transformers checkpoint, or ``None``: checked here,
    since transformers takes a path it cannot find for a Hub repo id and says so."""
    if not os.path.isdir(path):
        return "not a directory" if os.path.exists(path) else "no such directory"
    if not os.path.isfile(os.path.join(path, "config.json")):
        return "it has no config.json"
    if not any(name.endswith((".safetensors", ".bin")) for name in os.listdir(path)):
        return "it has no weights (*.safetensors or *.bin)"
    return None


def generate(model, ids_BS: torch.Tensor, new_tokens: int, device: torch.device,
             repeats: int):
    """Greedy-generate ``new_tokens`` (twice untimed, which compiles, then ``repeats``
    times, each timed): (tokens, the tokens/s of each timed run)."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    outputs = []
    times_ms = call_ms(lambda: outputs.append(model.generate(ids_BS, **kwargs)), repeats,
                       device, warmup=2)
    return outputs[-1], [ids_BS.shape[0] * new_tokens / (ms / 1e3) for ms in times_ms]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=FAMILY_NAMES, default="qwen3_moe",
                        help="family of the random model (ignored with --model)")
    parser.add_argument("--model", help="local directory with a transformers checkpoint")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=2, help="layers of the random model")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="timed generations of each model")
    parser.add_argument("--inner", choices=("inductor", "aot_eager", "eager"), default=None,
                        help="compiler after the MoE lowering (default: inductor on CUDA, "
                             "aot_eager on CPU, where Inductor's C++ build takes minutes)")
    args = parser.parse_args()
    problem = args.model and checkpoint_problem(args.model)
    if problem:
        parser.error(f"--model must be a local directory with a transformers checkpoint "
                     f"(config.json and *.safetensors or *.bin weights), got {args.model!r}: "
                     f"{problem}")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")

    torch.manual_seed(0)
    if args.model:
        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        name = args.model
    else:
        model = transformers.AutoModelForCausalLM.from_config(small_config(args.family,
                                                                           args.layers))
        name = f"random {args.family}, {args.layers} layers"
    model = model.to(device=device, dtype=dtype).eval()
    if args.model and os.path.exists(os.path.join(args.model, "tokenizer_config.json")):
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        ids_BS = tokenizer(["The capital of France is"] * args.batch,
                           return_tensors="pt").input_ids.to(device)
    else:
        tokenizer = None
        ids_BS = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_tokens),
                               device=device)

    with torch.no_grad():
        original_BS, original_tps = generate(model, ids_BS, args.new_tokens, device, args.repeats)
        report = hf.patch(model)
        print(report)
        patched_BS, patched_tps = generate(model, ids_BS, args.new_tokens, device, args.repeats)
        model.forward = torch.compile(model.forward, backend=tmo.backend(inner=inner),
                                      fullgraph=True)
        compiled_BS, compiled_tps = generate(model, ids_BS, args.new_tokens, device, args.repeats)

    print(f"\n{name} on {device} ({str(dtype).removeprefix('torch.')}), batch {args.batch}, "
          f"{args.new_tokens} new tokens")
    print(f"original:                 {summary(original_tps, 'tokens/s')}")
    print(f"patched, eager:           {summary(patched_tps, 'tokens/s')}")
    print(f"patched, compiled ({inner}): {summary(compiled_tps, 'tokens/s')}")
    new_BS = original_BS[:, ids_BS.shape[1]:]
    for label, out_BS in (("eager", patched_BS), ("compiled", compiled_BS)):
        same = (out_BS[:, ids_BS.shape[1]:] == new_BS).float().mean().item()
        # In bf16 a near tie between two tokens can go either way after rounding.
        print(f"new tokens equal to the original's, patched {label}: {same:.0%}")
    if tokenizer is not None:
        print(tokenizer.decode(compiled_BS[0], skip_special_tokens=True))


if __name__ == "__main__":
    main()
