"""moe-generate: run one prompt through the engine from the command line."""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
from pathlib import Path

from moe_serve.engine.cli_flags import ENV_HELP, DefaultsHelpFormatter, env_argv, fraction, positive_int
from moe_serve.engine.config import ConfigError, EngineConfig
from moe_serve.engine.experts.formats import EXPERT_QUANT_NAMES
from moe_serve.engine.experts.policies import POLICY_NAMES
from moe_serve.engine.logging_config import LOG_FORMATS, LOG_LEVELS, LogSettings
from moe_serve.engine.messages import GenerateRequest, SamplingParams

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "models" / "default"  # package data


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by moe-generate and moe-serve (the server imports this)."""
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    parser.add_argument("model_path", nargs="?", default=None, metavar="MODEL",
                        help="local Hugging Face checkpoint folder or GGUF file (the same as --model; default: the "
                             "embedded small code model)")
    parser.add_argument("--model", default=str(DEFAULT_MODEL), metavar="DIR|FILE.gguf",
                        help="local Hugging Face checkpoint folder, or a llama.cpp GGUF file (its experts kept in "
                             "their Q8_0/Q4_K/Q5_K/Q6_K blocks); hub ids are not downloaded")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="tokenizer folder, for prompts and for structured outputs' grammars (default: the "
                             "model's folder or GGUF file)")
    parser.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weights and activations (default: bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=EngineConfig.gpu_memory_utilization,
                        metavar="U", help="fraction of the GPU's memory that weights, activations, the KV cache and "
                                          "the expert cache share (ignored on cpu)")
    parser.add_argument("--gpu-expert-budget", default=None,
                        help="expert cache size: bytes (3GiB, 512MB) or a fraction of all expert bytes (25%%, 0.25) "
                             "(default: what --gpu-memory-utilization leaves)")
    parser.add_argument("--cache-policy", default=EngineConfig.cache_policy, choices=POLICY_NAMES,
                        help="expert eviction (next-use: the expert whose estimated next use is furthest away)")
    parser.add_argument("--prefetch", default="none", choices=["none", "next-layer"],
                        help="next-layer: prefetch the experts the next layers' gates guess from this hidden state")
    parser.add_argument("--prefetch-depth", type=int, default=1, help="layers ahead the next-layer predictor looks")
    parser.add_argument("--cpu-experts", default="off", choices=["off", "auto"],
                        help="auto: compute a missed expert on the CPU when a start-up profile says that beats "
                             "copying it to the GPU")
    parser.add_argument("--expert-quant", default=EngineConfig.expert_quant, choices=EXPERT_QUANT_NAMES,
                        help="quantize the routed experts at load (int8 per channel, int4 in groups of 128, fp8 e4m3 "
                             "per channel, a format quantized checkpoints and GGUF files publish, or llama.cpp's "
                             "q4_k_m / q5_k_m mix of them by layer): they are stored, "
                             "copied over PCIe and read by the kernels quantized; other weights keep --dtype. A "
                             "quantized checkpoint's experts keep their own format")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest prompt + completion in tokens (default: the model's own context length; "
                             "longer is an error)")
    parser.add_argument("--max-num-seqs", type=positive_int, default=EngineConfig.max_num_seqs,
                        help="sequences decoded together in one step (continuous batching)")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=EngineConfig.max_num_batched_tokens,
                        help="tokens per step: decodes plus chunks of prompts being prefilled")
    parser.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                        help="paged KV cache size, e.g. 2GiB (default: from --gpu-memory-utilization on cuda; "
                             "room for --max-num-seqs sequences of --max-model-len tokens on cpu)")
    parser.add_argument("--record-routing", default=None, metavar="FILE",
                        help="write routing decisions as JSONL (default: off)")
    parser.add_argument("--spec", default="off", choices=["off", "self", "draft"],
                        help="speculative decoding, alone or as a batch, wherever measured to beat plain "
                             "decoding: self-draft (SS-MoE) or an external dense draft (SP-MoE)")
    parser.add_argument("--draft", default=None, metavar="DIR",
                        help="dense draft checkpoint folder for --spec draft (default: none)")
    parser.add_argument("--spec-tokens", type=int, default=EngineConfig.spec_tokens,
                        help="max draft tokens per verify (gamma)")
    parser.add_argument("--spec-top-r", type=int, default=1, help="experts per layer the self-draft uses")
    parser.add_argument("--spec-confidence", type=float, default=0.0, help="stop drafting below this max-prob")
    parser.add_argument("--spec-cutoff", type=int, default=None,
                        help="prefetch for the first N target MoE layers while drafting (default: profiled)")
    parser.add_argument("--spec-adaptive-tokens", action="store_true",
                        help="adapt gamma per request from recent acceptance")
    parser.add_argument("--spec-switch", default="measured", choices=["measured", "always"],
                        help="measured: each batch size speculates while measured faster than plain decoding; "
                             "always: every step that may speculate does (benchmarks, tests)")
    parser.add_argument("--spec-adaptive-accept", type=float, default=None, metavar="T",
                        help="LOSSY SS-MoE adaptive acceptance with tolerance T (default: off, lossless)")
    parser.add_argument("--cuda-graphs", default="on", choices=["on", "off"],
                        help="replay decode, draft and verify forwards (up to 16 tokens) as CUDA graphs")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="let transformers run code shipped with the checkpoint's tokenizer")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="of the server, engine and uvicorn")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS,
                        help="json: one object a line (time, level, process, logger, message)")


def finish_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace,
                       command_line: list[str]) -> argparse.Namespace:
    """The positional MODEL and --model are one setting. The positional, given on the command line, beats a
    --model from a --config file or the environment; both on the command line and different is an error."""
    if args.model_path is not None:
        typed = any(arg == "--model" or arg.startswith("--model=") for arg in command_line)
        if typed and args.model != args.model_path:
            parser.error(f"two models given: {args.model_path} and --model {args.model}")
        args.model = args.model_path
    return args


def model_given(args: argparse.Namespace) -> bool:
    """Whether anything named a model, rather than the embedded default being used."""
    return args.model != str(DEFAULT_MODEL)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return EngineConfig(
        model=args.model, tokenizer=args.tokenizer, device=device, dtype=args.dtype,
        gpu_expert_budget=args.gpu_expert_budget, gpu_memory_utilization=args.gpu_memory_utilization,
        cache_policy=args.cache_policy, prefetch=args.prefetch, prefetch_depth=args.prefetch_depth,
        cpu_experts=args.cpu_experts, expert_quant=args.expert_quant,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
        record_routing=args.record_routing, spec=args.spec, draft=args.draft,
        spec_tokens=args.spec_tokens, spec_top_r=args.spec_top_r, spec_confidence=args.spec_confidence,
        spec_cutoff=args.spec_cutoff, spec_adaptive_tokens=args.spec_adaptive_tokens,
        spec_switch=args.spec_switch, spec_adaptive_accept=args.spec_adaptive_accept,
        cuda_graphs=args.cuda_graphs == "on",
        trust_remote_code=args.trust_remote_code, logging=LogSettings(args.log_level, args.log_format),
    )


def package_version() -> str:
    try:
        return importlib.metadata.version("moe-serve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="moe-generate", description=f"{__doc__} {ENV_HELP}",
                                     formatter_class=DefaultsHelpFormatter)
    add_engine_arguments(parser)
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs tokenizer files in the model directory or --tokenizer)")
    prompt.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with token_ids, text and stats")
    argv = list(sys.argv[1:] if argv is None else argv)
    return finish_engine_args(parser, parser.parse_args(env_argv(parser) + argv), argv)


def _load_tokenizer(tokenizer_path: str, trust_remote_code: bool):
    from moe_serve.engine.gguf import is_gguf, load_tokenizer
    from moe_serve.engine.preflight import TOKENIZER_FILES

    if not is_gguf(tokenizer_path) and not any((Path(tokenizer_path) / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        return load_tokenizer(tokenizer_path, trust_remote_code)  # a GGUF's is built here: a ValueError naming why
    except (OSError, ValueError) as exc:
        sys.exit(f"moe-generate: cannot load the tokenizer in {tokenizer_path}: {exc}")


def main(argv: list[str] | None = None) -> int:
    # here: moe-serve imports this module's flags only, and --help needs no torch
    from moe_serve.engine.core import EngineCore, run_to_completion
    from moe_serve.engine.loader import LoadError
    from moe_serve.engine.preflight import check_engine_config

    args = _parse_args(argv)
    config = engine_config_from_args(args)
    config.logging.apply()
    try:
        check_engine_config(config)
    except ConfigError as exc:
        sys.exit(f"moe-generate: {exc}")
    tokenizer = _load_tokenizer(config.tokenizer_path, args.trust_remote_code)
    if args.prompt is not None:
        if tokenizer is None:
            sys.exit(f"moe-generate: {config.tokenizer_path} has no tokenizer files; pass --tokenizer DIR, or "
                     "--prompt-ids instead of --prompt")
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    stop_ids = () if tokenizer is None or tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_token_ids=stop_ids)
    try:
        core = EngineCore(config)
    except (ConfigError, LoadError) as exc:  # what only loading can tell: memory plan, tensor names
        sys.exit(f"moe-generate: {exc}")
    try:
        done = run_to_completion(core, GenerateRequest("cli", tuple(prompt_ids), params))
        stats = core.runtime.generation_stats(ttft_seconds=done.ttft_seconds, tpot_seconds=done.tpot_seconds)
    except RuntimeError as exc:
        sys.exit(f"moe-generate: {exc}")
    finally:
        core.close()
    text = tokenizer.decode(done.token_ids, skip_special_tokens=True) if tokenizer is not None else None
    if args.json:
        result = {"token_ids": done.token_ids, "stats": stats}
        if text is not None:
            result["text"] = text
        print(json.dumps(result))
    else:
        print(text if text is not None else " ".join(map(str, done.token_ids)))
        print(json.dumps(stats), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
