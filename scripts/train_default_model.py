"""Train the embedded default model pair: a dense Qwen3 draft and a Qwen3-MoE target.

Training text: the stdlib's training split plus the Python sources of permissively licensed
installed packages (package_corpus.py); validation and held-out text is stdlib only.

Three phases, one seed:
  1. draft:   a dense Qwen3ForCausalLM trained from scratch;
  2. target:  a Qwen3MoeForCausalLM upcycled from the draft as it was after --upcycle-at steps
              (by default its last: attention, norms and embeddings copied, every expert a
              noisy copy of the draft's MLP, router small-random), then trained on with a
              per-layer load-balancing loss and dropout inside the experts.  On the stdlib
              alone (7.8M tokens) this target memorised and ended worse than its draft; with
              the package sources the corpus is several times larger (moe_serve/models/default/README.md);
  3. distill: the draft takes the target's shared parts (embeddings, attention, norms) and is
              distilled towards it (logits KL plus cosine distance of every post-attention
              residual), so it agrees with the target's greedy tokens and, through its
              residual stream, with the target's routes (SP-MoE), while staying a small dense
              model with a worse perplexity.

  prepare (here, CPU, once):  python scripts/train_default_model.py prepare
  train (the GPU):            python scripts/train_default_model.py train --out DIR
  end-to-end CPU check:       python scripts/train_default_model.py train --smoke --out /tmp/x
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import (
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerBase,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import package_corpus  # noqa: E402  (sibling scripts, not a package)
import stdlib_corpus as corpus  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGET_DIR = REPO / "moe_serve" / "models" / "default"
DRAFT_DIR = REPO / "moe_serve" / "models" / "default-draft"
WORK_DIR = REPO / ".out" / "default-model"  # ignored by git; carried to the GPU machine
CORPUS_PATH = WORK_DIR / "stdlib-corpus.jsonl.xz"  # built by `prepare` from CPython 3.11.7
PACKAGES_CORPUS_PATH = WORK_DIR / "packages-corpus.jsonl.xz"  # training text only, also `prepare`
PACKAGES_MANIFEST_PATH = WORK_DIR / "packages-manifest.json"  # versions, licences, files, tokens
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MAX_SHARD_SIZE = "15MB"  # the GPU machine returns files of at most 16 MiB


@dataclass(frozen=True)
class Shape:
    vocab_size: int = 8192
    hidden_size: int = 256
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256  # the draft's MLP and each expert: upcycling copies one into the other
    num_experts: int = 8
    top_k: int = 2
    max_len: int = 1024


SMOKE_SHAPE = Shape(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                    intermediate_size=64, max_len=128)


@dataclass(frozen=True)
class Phase:
    steps: int
    lr: float
    warmup: int
    batch_size: int
    seq_len: int
    budget_s: float  # wall-clock cap: a phase cut short still leaves time for the next ones
    keep_best: bool  # restore the weights with the lowest validation loss (early stopping)
    eval_every: int = 250


@dataclass(frozen=True)
class Recipe:
    seed: int = 1234
    distill_shared_lr_scale: float = 0.1  # phase 3 keeps the target's attention nearly as it is
    router_aux_loss_coef: float = 0.05  # on the mean over layers of per-layer balance losses
    # (~0.008 a layer; Switch uses 0.01): transformers' own loss pools all layers' tokens, which let
    # the first layer send 98% of its tokens to two experts, and 0.01 still left it at 86% on two
    expert_dropout: float = 0.1  # on each expert's hidden units while the target trains (Switch)
    upcycle_noise: float = 0.01  # relative std of the noise that breaks the experts' symmetry
    router_init_std: float = 0.02
    kd_weight: float = 1.0  # phase 3 loss = CE + kd_weight * KL + hidden_weight * (1 - cos)
    hidden_weight: float = 1.0
    weight_decay: float = 0.1
    experts_implementation: str = "grouped_mm"


# ---------------------------------------------------------------- configs and upcycling


def _special_ids(tok: PreTrainedTokenizerBase) -> dict[str, int]:
    return {"eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id, "bos_token_id": None}


def _common_config(shape: Shape, tok: PreTrainedTokenizerBase) -> dict:
    return dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=shape.max_len, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_special_ids(tok),
    )


def draft_config(shape: Shape, tok: PreTrainedTokenizerBase) -> Qwen3Config:
    return Qwen3Config(intermediate_size=shape.intermediate_size, **_common_config(shape, tok))


def target_config(shape: Shape, tok: PreTrainedTokenizerBase, recipe: Recipe) -> Qwen3MoeConfig:
    config = Qwen3MoeConfig(
        intermediate_size=shape.intermediate_size, moe_intermediate_size=shape.intermediate_size,
        num_experts=shape.num_experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True,
        router_aux_loss_coef=recipe.router_aux_loss_coef, decoder_sparse_step=1,
        **_common_config(shape, tok),
    )
    config._experts_implementation = recipe.experts_implementation
    return config


@torch.no_grad()
def upcycle(draft: Qwen3ForCausalLM, config: Qwen3MoeConfig, recipe: Recipe,
            gen: torch.Generator) -> Qwen3MoeForCausalLM:
    """The target starts as the draft: with noise 0 its logits equal the draft's, because
    every expert is the draft's MLP and the renormalised top-k weights sum to one."""
    target = Qwen3MoeForCausalLM(config).to(draft.device)
    missing, unexpected = target.load_state_dict(draft.state_dict(), strict=False)
    if any(".mlp." not in k for k in missing + unexpected):
        raise RuntimeError(f"draft and target differ outside the MLP: {missing} {unexpected}")
    for d_layer, t_layer in zip(draft.model.layers, target.model.layers):
        gate_up = torch.cat([d_layer.mlp.gate_proj.weight, d_layer.mlp.up_proj.weight])  # [2I, H]
        down = d_layer.mlp.down_proj.weight  # [H, I]
        experts = t_layer.mlp.experts
        experts.gate_up_proj.copy_(_noisy_copies(gate_up, experts.gate_up_proj.shape[0], recipe, gen))
        experts.down_proj.copy_(_noisy_copies(down, experts.down_proj.shape[0], recipe, gen))
        router = t_layer.mlp.gate.weight  # [E, H]
        router.copy_(torch.randn(router.shape, generator=gen) * recipe.router_init_std)
    return target


def _noisy_copies(w: torch.Tensor, n: int, recipe: Recipe, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randn((n, *w.shape), generator=gen).to(w.device)  # [E, *w.shape]
    return w.unsqueeze(0) + noise * (recipe.upcycle_noise * w.std())


class ExpertDropout(torch.nn.Module):
    """Switch Transformer's expert dropout: wraps an experts block's activation, whose output
    multiplies the up projection, so dropping an activated gate unit drops that hidden unit.
    No parameters: the state dict and the saved checkpoint are unchanged."""

    def __init__(self, act: torch.nn.Module, p: float):
        super().__init__()
        self.act, self.p = act, p

    def forward(self, gate: torch.Tensor) -> torch.Tensor:  # [S, I]
        return F.dropout(self.act(gate), self.p, self.training)


def set_expert_dropout(model: Qwen3MoeForCausalLM, p: float) -> None:
    """p > 0 wraps every layer's expert activation in ExpertDropout; p = 0 unwraps it."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        act = experts.act_fn.act if isinstance(experts.act_fn, ExpertDropout) else experts.act_fn
        experts.act_fn = ExpertDropout(act, p) if p > 0 else act


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def copy_shared_parts(src: torch.nn.Module, dst: torch.nn.Module) -> None:
    """Embeddings, attention and norms: every tensor outside the MLP/MoE blocks."""
    shared = {k: v for k, v in src.state_dict().items() if ".mlp." not in k}
    missing, unexpected = dst.load_state_dict(shared, strict=False)
    if unexpected or any(".mlp." not in k for k in missing):
        raise RuntimeError(f"shared parts do not match: {missing} {unexpected}")


def is_shared_param(name: str) -> bool:
    return ".mlp." not in name


# ---------------------------------------------------------------- data


class TokenStream:
    """Training files (or held-out files) as one token stream, cut at random offsets."""

    def __init__(self, ids: torch.Tensor, seed: int):
        self.ids = ids  # [N] int64, on the training device
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.ids) - seq_len, (batch_size,), generator=self.gen)
        idx = starts.unsqueeze(1) + torch.arange(seq_len)  # [B, T]
        return self.ids[idx.to(self.ids.device)]

    def windows(self, n: int, seq_len: int) -> torch.Tensor:
        """The first n (or as many as fit) non-overlapping windows: a fixed evaluation set."""
        n = min(n, len(self.ids) // seq_len)
        return self.ids[: n * seq_len].view(n, seq_len)


def plain_text(doc: corpus.Document) -> str:
    return doc.text


def tokenize(docs: list[corpus.Document], tok: PreTrainedTokenizerBase,
             text_of: Callable[[corpus.Document], str], chunk: int = 512) -> torch.Tensor:
    """Every document's tokens followed by end-of-text, concatenated; in chunks, so tens of
    millions of tokens never sit in one Python list."""
    parts = [torch.zeros(0, dtype=torch.long)]
    for i in range(0, len(docs), chunk):
        ids: list[int] = []
        for row in tok([text_of(d) for d in docs[i:i + chunk]], add_special_tokens=False)["input_ids"]:
            ids.extend(row)
            ids.append(tok.eos_token_id)
        parts.append(torch.tensor(ids, dtype=torch.long))
    return torch.cat(parts)  # [N]


# ---------------------------------------------------------------- training


class ResidualTap:
    """Records each layer's residual stream after attention: the input of
    post_attention_layernorm, i.e. what a MoE router sees before that norm."""

    def __init__(self, model: torch.nn.Module):
        layers = model.model.layers
        self.residuals: list[torch.Tensor | None] = [None] * len(layers)
        self._handles = [layer.post_attention_layernorm.register_forward_pre_hook(partial(self._store, i))
                         for i, layer in enumerate(layers)]

    def _store(self, layer: int, module: torch.nn.Module, args: tuple) -> None:
        self.residuals[layer] = args[0]

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def lr_at(step: int, phase: Phase) -> float:
    """Linear warm-up, then cosine down to a tenth of the peak."""
    if step < phase.warmup:
        return phase.lr * (step + 1) / phase.warmup
    progress = (step - phase.warmup) / max(1, phase.steps - phase.warmup)
    return phase.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, recipe: Recipe, shared_scale: float) -> torch.optim.AdamW:
    groups: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
    for name, p in model.named_parameters():
        groups.setdefault((is_shared_param(name), p.ndim >= 2), []).append(p)
    param_groups = [
        {"params": ps, "lr_scale": shared_scale if shared else 1.0,
         "weight_decay": recipe.weight_decay if matrix else 0.0}
        for (shared, matrix), ps in groups.items()
    ]
    fused = next(model.parameters()).is_cuda
    return torch.optim.AdamW(param_groups, betas=(0.9, 0.95), fused=fused)


LossFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def run_phase(name: str, model: torch.nn.Module, loss_fn: LossFn, opt: torch.optim.Optimizer,
              phase: Phase, stream: TokenStream, val_windows: torch.Tensor, log: list[dict],
              after_step: Callable[[int], None] = lambda step: None) -> dict:
    start = time.monotonic()
    best = {"validation_loss": math.inf, "step": -1}
    best_state: dict[str, torch.Tensor] = {}
    step = 0
    for step in range(phase.steps):
        if time.monotonic() - start > phase.budget_s:
            break
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, phase) * group["lr_scale"]
        batch = stream.batch(phase.batch_size, phase.seq_len)  # [B, T]
        with autocast(batch.device):
            loss, parts = loss_fn(batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        after_step(step)
        row = {"phase": name, "step": step, "s": round(time.monotonic() - start, 1),
               "loss": round(loss.item(), 4), **{k: round(v, 4) for k, v in parts.items()}}
        if (step + 1) % phase.eval_every == 0 or step == phase.steps - 1:
            row["validation_loss"] = round(heldout_loss(model, val_windows, phase.batch_size), 4)
            if phase.keep_best and row["validation_loss"] < best["validation_loss"]:
                best = {"validation_loss": row["validation_loss"], "step": step}
                best_state = snapshot(model)
        if step % 50 == 0 or "validation_loss" in row:
            log.append(row)
            print(json.dumps(row), flush=True)
    if best_state:
        model.load_state_dict(best_state)
    return {"steps_done": step + 1, "steps_planned": phase.steps, "seconds": round(time.monotonic() - start, 1),
            "tokens": (step + 1) * phase.batch_size * phase.seq_len, "kept": best if phase.keep_best else "last"}


def autocast(device: torch.device) -> torch.autocast:
    # bf16 on the GPU; CPU smoke runs stay in fp32, where bf16 autocast only costs time
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    out = model(input_ids=batch, labels=batch)
    return out.loss, {}


def balance_loss(router_logits: tuple[torch.Tensor, ...], top_k: int) -> torch.Tensor:
    """Switch-style E * sum_e f_e * P_e for each layer, averaged over layers (1.0 = balanced)."""
    losses = []
    for logits in router_logits:  # [N, E]
        probs = logits.float().softmax(-1)
        picked = F.one_hot(probs.topk(top_k, dim=-1).indices, probs.shape[-1]).sum(1)  # [N, E]
        share = picked.float().mean(0) / top_k  # f_e
        losses.append(probs.shape[-1] * (share * probs.mean(0)).sum())
    return torch.stack(losses).mean()


def moe_loss(model: Qwen3MoeForCausalLM, batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    out = model(input_ids=batch, output_router_logits=True)  # no labels: our own balance loss
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())
    aux = balance_loss(out.router_logits, model.config.num_experts_per_tok)
    return ce + model.config.router_aux_loss_coef * aux, {"ce": ce.item(), "aux": aux.item()}


def distill_loss(draft: Qwen3ForCausalLM, target: Qwen3MoeForCausalLM, draft_tap: ResidualTap,
                 target_tap: ResidualTap, recipe: Recipe,
                 batch: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    with torch.no_grad():
        t_logits = target(input_ids=batch).logits.float()  # [B, T, V]
    out = draft(input_ids=batch, labels=batch)
    kl = F.kl_div(F.log_softmax(out.logits.float(), -1), F.log_softmax(t_logits, -1),
                  log_target=True, reduction="none").sum(-1).mean()
    cos = torch.stack([F.cosine_similarity(d.float(), t.float(), dim=-1).mean()
                       for d, t in zip(draft_tap.residuals, target_tap.residuals)])  # [L]
    hidden = (1 - cos).mean()
    loss = out.loss + recipe.kd_weight * kl + recipe.hidden_weight * hidden
    return loss, {"ce": out.loss.item(), "kl": kl.item(), "cos_min": cos.min().item()}


@torch.no_grad()
def heldout_loss(model: torch.nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = []
    for chunk in windows.split(batch_size):
        with autocast(chunk.device):
            losses.append(model(input_ids=chunk, labels=chunk).loss.float())
    return torch.stack(losses).mean().item()


# ---------------------------------------------------------------- saving


def save_model(model: torch.nn.Module, tok: PreTrainedTokenizerBase, out_dir: Path) -> None:
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids(corpus.IM_END)],
        pad_token_id=tok.pad_token_id, bos_token_id=None, do_sample=False,
    )
    model.save_pretrained(out_dir, max_shard_size=MAX_SHARD_SIZE)
    tok.save_pretrained(out_dir)  # a complete HF directory; the repo keeps its committed copy


def pack_for_transfer(out: Path, dirs: list[Path], part_bytes: int = 15 * 2**20) -> None:
    """The GPU machine returns at most 8 flat-ish files under 16 MiB: one tar, split in parts."""
    tar = out / "models.tar"
    subprocess.run(["tar", "-cf", str(tar), "-C", str(out), *[d.name for d in dirs]], check=True)
    subprocess.run(["split", "-b", str(part_bytes), "-d", str(tar), str(out / "models.tar.part")], check=True)
    tar.unlink()
    for d in dirs:
        shutil.rmtree(d)


# ---------------------------------------------------------------- commands


def prepare(vocab_size: int, max_len: int, retrain_tokenizer: bool) -> None:
    """Corpus files (carried to the GPU, not committed) and their manifest; with
    retrain_tokenizer also the tokenizer (committed, both dirs; trained on the stdlib's
    training split only, so the package sources never change it)."""
    docs = corpus.collect_stdlib(corpus.stdlib_root())
    corpus.write_corpus(docs, CORPUS_PATH)
    if retrain_tokenizer:
        tok = corpus.train_tokenizer(corpus.split(docs, "train"), vocab_size, max_len)
        for d in (TARGET_DIR, DRAFT_DIR):
            tok.save_pretrained(d)
    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    protected = corpus.split(docs, "validation") + corpus.split(docs, "heldout")
    by_package, manifest = package_corpus.collect_packages(docs, protected)
    extra = sorted((d for ds in by_package.values() for d in ds), key=lambda d: d.relpath)
    corpus.write_corpus(extra, PACKAGES_CORPUS_PATH)
    for name, package_docs in by_package.items():
        manifest[name]["tokens"] = len(tokenize(package_docs, tok, corpus.training_text))
    counts = {name: {"files": len(corpus.split(docs, name)),
                     "tokens": len(tokenize(corpus.split(docs, name), tok, corpus.training_text))}
              for name in ("train", "validation", "heldout")}
    summary = {"python": sys.version.split()[0], "stdlib": counts,
               "packages": {"files": len(extra), "bytes": sum(len(d.text.encode()) for d in extra),
                            "tokens": sum(r.get("tokens", 0) for r in manifest.values())}}
    PACKAGES_MANIFEST_PATH.write_text(json.dumps(summary | {"per_package": manifest}, indent=1) + "\n")
    print(json.dumps(summary | {"corpus": str(CORPUS_PATH), "packages_corpus": str(PACKAGES_CORPUS_PATH)}))


def phases(args: argparse.Namespace, seq_len: int, deadline_s: float) -> tuple[Phase, Phase, Phase]:
    """Wall-clock shares 28/46/22 of the deadline (the default steps' measured H100 times plus
    slack), so a slower machine still ends with all three models."""
    common = dict(batch_size=args.batch_size, seq_len=seq_len)
    return (
        Phase(args.draft_steps, 2e-3, min(200, args.draft_steps // 10 + 1),
              budget_s=0.28 * deadline_s, keep_best=False, **common),
        Phase(args.target_steps, 1.5e-3, min(200, args.target_steps // 10 + 1),
              budget_s=0.46 * deadline_s, keep_best=True, **common),
        Phase(args.distill_steps, 1e-3, min(100, args.distill_steps // 10 + 1),
              budget_s=0.22 * deadline_s, keep_best=False, **common),
    )


def train(args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    recipe = replace(Recipe(), experts_implementation=args.experts_implementation)
    shape = SMOKE_SHAPE if args.smoke else Shape()
    torch.manual_seed(recipe.seed)
    gen = torch.Generator().manual_seed(recipe.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True

    tok = AutoTokenizer.from_pretrained(TARGET_DIR)
    docs = corpus.read_corpus(Path(args.corpus))
    extra = corpus.read_corpus(Path(args.packages_corpus)) if args.packages_corpus else []
    limit = 40 if args.smoke else None
    stdlib_ids = tokenize(corpus.split(docs, "train")[:limit], tok, corpus.training_text)
    extra_ids = tokenize(extra[:limit], tok, corpus.training_text)
    stream = TokenStream(torch.cat([stdlib_ids, extra_ids]).to(device), recipe.seed)
    seq_len = args.seq_len or shape.max_len
    val_windows, eval_windows = (
        TokenStream(tokenize(corpus.split(docs, name)[:limit], tok, plain_text).to(device), recipe.seed)
        .windows(args.eval_windows, seq_len) for name in ("validation", "heldout"))
    train_tokens = {"stdlib": len(stdlib_ids), "packages": len(extra_ids), "total": len(stream.ids),
                    "tokenize_s": round(time.monotonic() - t0, 1)}
    print(json.dumps({"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
                      "cpus": os.cpu_count(), "train_tokens": train_tokens,
                      "shape": asdict(shape)}), flush=True)

    draft_phase, target_phase, distill_phase = phases(args, seq_len, args.deadline_s - (time.monotonic() - t0))
    log: list[dict] = []
    report: dict = {"recipe": asdict(recipe), "shape": asdict(shape), "args": vars(args),
                    "train_tokens": train_tokens}

    draft = Qwen3ForCausalLM(draft_config(shape, tok)).to(device)
    early: dict[str, torch.Tensor] = {}

    def keep_early(step: int) -> None:
        if step + 1 == args.upcycle_at:
            early.update(snapshot(draft))

    report["draft_phase"] = run_phase("draft", draft, partial(lm_loss, draft), make_optimizer(draft, recipe, 1.0),
                                      draft_phase, stream, val_windows, log, keep_early)
    report["draft_heldout_loss_after_pretraining"] = heldout_loss(draft, eval_windows, args.batch_size)

    early_draft = Qwen3ForCausalLM(draft.config).to(device)
    early_draft.load_state_dict(early or snapshot(draft))  # a phase cut short upcycles its last step
    report["upcycled_from_draft_step"] = args.upcycle_at if early else report["draft_phase"]["steps_done"]
    target = upcycle(early_draft, target_config(shape, tok, recipe), recipe, gen)
    del early_draft, early
    report["target_heldout_loss_at_upcycling"] = heldout_loss(target, eval_windows, args.batch_size)
    set_expert_dropout(target, recipe.expert_dropout)
    report["target_phase"] = run_phase("target", target, partial(moe_loss, target),
                                       make_optimizer(target, recipe, 1.0), target_phase, stream, val_windows, log)
    set_expert_dropout(target, 0.0)
    report["target_heldout_loss"] = heldout_loss(target, eval_windows, args.batch_size)

    copy_shared_parts(target, draft)
    target.eval().requires_grad_(False)
    taps = ResidualTap(draft), ResidualTap(target)
    report["distill_phase"] = run_phase("distill", draft, partial(distill_loss, draft, target, *taps, recipe),
                                        make_optimizer(draft, recipe, recipe.distill_shared_lr_scale),
                                        distill_phase, stream, val_windows, log)
    for tap in taps:
        tap.close()
    report["draft_heldout_loss"] = heldout_loss(draft, eval_windows, args.batch_size)

    out = Path(args.out)
    save_model(target, tok, out / "default")
    save_model(draft, tok, out / "default-draft")
    report["log"] = log
    report["total_seconds"] = round(time.monotonic() - t0, 1)
    (out / "train_report.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({k: v for k, v in report.items() if k != "log"}), flush=True)
    if args.pack:
        pack_for_transfer(out, [out / "default", out / "default-draft"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare", help="build the corpus file and train the tokenizer (CPU)")
    prep.add_argument("--vocab-size", type=int, default=Shape.vocab_size)
    prep.add_argument("--retrain-tokenizer", action="store_true",
                      help="also retrain the committed tokenizer (on the stdlib training split)")
    tr = sub.add_parser("train", help="train draft, upcycled target, distilled draft")
    tr.add_argument("--out", required=True)
    tr.add_argument("--corpus", default=str(CORPUS_PATH), help="stdlib: training, validation and held-out files")
    tr.add_argument("--packages-corpus", default=str(PACKAGES_CORPUS_PATH),
                    help="extra training files ('' for none)")
    tr.add_argument("--smoke", action="store_true", help="tiny shapes and data: an end-to-end check on CPU")
    # ~118 s, ~190 s (+ expert dropout) and ~91 s on the H100 (25.5, 12.6 and 13.2 steps/s measured there)
    tr.add_argument("--draft-steps", type=int, default=3000)
    tr.add_argument("--upcycle-at", type=int, help="the draft step the target starts from (default: the last)")
    tr.add_argument("--target-steps", type=int, default=2400)
    tr.add_argument("--distill-steps", type=int, default=1200)
    tr.add_argument("--batch-size", type=int, default=32)
    tr.add_argument("--seq-len", type=int, help="default: the shape's max_len")
    tr.add_argument("--eval-windows", type=int, default=48, help="windows of validation and of held-out text")
    tr.add_argument("--deadline-s", type=float, default=520.0,
                    help="wall clock from start (tokenising included) to the last phase's end")
    tr.add_argument("--experts-implementation", default=Recipe.experts_implementation)
    tr.add_argument("--pack", action="store_true", help="tar and split the models for the device's file limits")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args.vocab_size, Shape.max_len, args.retrain_tokenizer)
    else:
        train(args)


if __name__ == "__main__":
    main()
