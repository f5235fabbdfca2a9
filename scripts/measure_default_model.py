"""Measure the default target/draft pair on held-out stdlib files; prints one JSON object.

Figures (all with transformers' own classes, fp32, CPU by default):
  perplexity            per-token, over non-overlapping held-out windows, draft and target, and
                        on how many of those windows the target's is the lower;
  expert_load           per layer: share of top-k picks per expert, entropy vs log(E);
  temporal_locality     per layer: mean |S_t ∩ S_t+1| / k over adjacent tokens of a window;
  next_layer_gate       per layer l: layer l+1's norm + router applied to the residual entering
                        layer l's MoE, scored against layer l+1's true top-k (|pred ∩ true| / k);
  draft_to_target_gate  per layer l (SP-MoE Fig. 7): the draft's residual after attention at
                        layer l, through the target's post_attention_layernorm + router at l,
                        scored against the target's true top-k; with the residuals' cosine;
  acceptance            greedy speculative decoding simulated on held-out prompts, gamma tokens a
                        round: accepted draft tokens / drafted tokens, for the SS-MoE self-draft
                        (the target on the top-1 of its top-k experts, renormalised) and for the
                        external dense draft.

  python scripts/measure_default_model.py [--out moe_serve/models/default/measurements.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stdlib_corpus as corpus  # noqa: E402
from train_default_model import (  # noqa: E402
    CORPUS_PATH, DRAFT_DIR, TARGET_DIR, ResidualTap, TokenStream, plain_text, tokenize)


def overlap(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """|pred ∩ true| / k per row; pred, true: [N, k] expert ids."""
    return (pred.unsqueeze(-1) == true.unsqueeze(-2)).any(-1).float().mean(-1)  # [N]


def route(layer: torch.nn.Module, residual: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k experts that `layer`'s norm + router pick for a residual stream [N, H]."""
    logits = F.linear(layer.post_attention_layernorm(residual), layer.mlp.gate.weight)  # [N, E]
    return logits.topk(k, dim=-1).indices  # [N, k]


@dataclass
class RoutingStats:
    num_layers: int
    num_experts: int
    top_k: int
    load: torch.Tensor = field(init=False)  # [L, E] top-k picks
    sums: dict[str, torch.Tensor] = field(init=False)  # per-layer sums of per-token scores
    counts: dict[str, torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.load = torch.zeros(self.num_layers, self.num_experts)
        self.sums, self.counts = {}, {}

    def add(self, name: str, layer: int, scores: torch.Tensor) -> None:
        self.sums.setdefault(name, torch.zeros(self.num_layers))[layer] += scores.sum().item()
        self.counts.setdefault(name, torch.zeros(self.num_layers))[layer] += scores.numel()

    def mean(self, name: str, layers: range) -> list[float]:
        return [round((self.sums[name][l] / self.counts[name][l]).item(), 4) for l in layers]

    def load_report(self) -> list[dict]:
        share = self.load / self.load.sum(-1, keepdim=True)  # [L, E]
        entropy = -(share * share.clamp_min(1e-12).log()).sum(-1)  # [L]
        return [{"layer": l, "share": [round(x, 4) for x in share[l].tolist()],
                 "entropy": round(entropy[l].item(), 4), "log_E": round(math.log(self.num_experts), 4)}
                for l in range(self.num_layers)]


def next_token_nll(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Each window's summed next-token negative log-likelihood [B], for batch [B, T] under logits
    [B, T, V]. Never a MoE's `loss`: called with output_router_logits, that adds
    router_aux_loss_coef x the balance loss."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), batch[:, 1:], reduction="none").sum(-1)


@torch.no_grad()
def measure_windows(target: PreTrainedModel, draft: PreTrainedModel, windows: torch.Tensor,
                    batch_size: int) -> tuple[dict, RoutingStats]:
    cfg = target.config
    k, n_layers = cfg.num_experts_per_tok, cfg.num_hidden_layers
    stats = RoutingStats(n_layers, cfg.num_experts, k)
    nll: dict[str, list[torch.Tensor]] = {"target": [], "draft": []}  # per-window sums
    t_tap, d_tap = ResidualTap(target), ResidualTap(draft)
    layers = target.model.layers
    for batch in windows.split(batch_size):  # [B, T]
        b, t = batch.shape
        t_out = target(input_ids=batch, output_router_logits=True)
        d_out = draft(input_ids=batch)
        nll["target"].append(next_token_nll(t_out.logits, batch))
        nll["draft"].append(next_token_nll(d_out.logits, batch))
        true = [logits.topk(k, dim=-1).indices for logits in t_out.router_logits]  # L x [B*T, k]
        # copied out now: route() below runs the norms again, which re-fires the taps
        t_residuals = [r.reshape(b * t, -1) for r in t_tap.residuals]  # L x [B*T, H]
        d_residuals = [r.reshape(b * t, -1) for r in d_tap.residuals]
        for l in range(n_layers):
            stats.load[l] += torch.bincount(true[l].flatten(), minlength=cfg.num_experts).float()
            pairs = true[l].view(b, t, k)
            stats.add("temporal_locality", l, overlap(pairs[:, 1:].reshape(-1, k), pairs[:, :-1].reshape(-1, k)))
            d_res, t_res = d_residuals[l], t_residuals[l]
            stats.add("draft_to_target_gate", l, overlap(route(layers[l], d_res, k), true[l]))
            stats.add("residual_cosine", l, torch.cosine_similarity(d_res, t_res, dim=-1))
            if l + 1 < n_layers:
                stats.add("next_layer_gate", l, overlap(route(layers[l + 1], t_res, k), true[l + 1]))
    t_tap.close()
    d_tap.close()
    tokens = windows.shape[0] * (windows.shape[1] - 1)
    t_nll, d_nll = torch.cat(nll["target"]), torch.cat(nll["draft"])  # [W]
    ppl = {name: round(math.exp(torch.cat(sums).sum().item() / tokens), 4) for name, sums in nll.items()}
    better = f"{int((t_nll < d_nll).sum())}/{len(t_nll)}"
    return {"perplexity": ppl, "scored_tokens": tokens, "windows_target_better_than_draft": better}, stats


def self_drafter(target: PreTrainedModel) -> PreTrainedModel:
    """SS-MoE's drafter: the target itself on the top-1 of its top-k experts; with
    norm_topk_prob the single weight renormalises to 1."""
    drafter = copy.deepcopy(target)
    for layer in drafter.model.layers:
        layer.mlp.gate.top_k = 1
    return drafter


def greedy(model: PreTrainedModel, prefix: torch.Tensor, n: int) -> torch.Tensor:
    out = model.generate(prefix.unsqueeze(0), max_new_tokens=n, do_sample=False)
    return out[0, prefix.numel():]


class GreedyDrafter:
    """Drafts greedily with a KV cache kept across rounds and cropped to the accepted prefix,
    as a real speculative decoder would; saves re-reading the prompt every round."""

    def __init__(self, model: PreTrainedModel, prompt: torch.Tensor):
        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.fed: list[int] = []  # tokens whose keys/values the cache holds
        self.pending = prompt.tolist()  # tokens the true sequence has beyond self.fed

    def draft(self, n: int) -> list[int]:
        proposal: list[int] = []
        ids = self.pending
        for _ in range(n):
            logits = self.model(input_ids=torch.tensor([ids]), past_key_values=self.cache,
                                use_cache=True).logits  # [1, len(ids), V]
            self.fed += ids
            proposal.append(int(logits[0, -1].argmax()))
            ids = proposal[-1:]
        return proposal

    def advance(self, true_tokens: list[int]) -> None:
        """true_tokens: the whole sequence now; keep the cache where it agrees with it."""
        keep = 0
        while keep < min(len(self.fed), len(true_tokens)) and self.fed[keep] == true_tokens[keep]:
            keep += 1
        if keep < len(self.fed):
            self.cache.crop(keep - len(self.fed))  # a negative count: tokens to drop, in every version
        self.fed = self.fed[:keep]
        self.pending = true_tokens[keep:]


@torch.no_grad()
def acceptance(target: PreTrainedModel, drafter: PreTrainedModel, prompts: torch.Tensor,
               new_tokens: int, gamma: int) -> dict:
    """Greedy speculative decoding accepts exactly the longest prefix of the draft that matches
    the target's own greedy continuation, plus one target token; simulated on that continuation."""
    drafted = accepted = rounds = emitted = 0
    for prompt in prompts:  # [P]
        reference = greedy(target, prompt, new_tokens).tolist()  # n <= new_tokens tokens
        state = GreedyDrafter(drafter, prompt)
        pos = 0
        while pos < len(reference):
            proposal = state.draft(min(gamma, len(reference) - pos))
            run = 0
            while run < len(proposal) and proposal[run] == reference[pos + run]:
                run += 1
            drafted, accepted, rounds = drafted + len(proposal), accepted + run, rounds + 1
            pos += run + 1
            state.advance(prompt.tolist() + reference[:pos])
        emitted += len(reference)
    return {"acceptance_rate": round(accepted / drafted, 4), "gamma": gamma,
            "tokens_per_target_pass": round(emitted / rounds, 3), "rounds": rounds}


def heldout_stream(tok, corpus_path: Path) -> tuple[torch.Tensor, str]:
    if corpus_path.exists():
        docs, source = corpus.read_corpus(corpus_path), str(corpus_path)
    else:
        docs, source = corpus.collect_stdlib(corpus.stdlib_root()), f"stdlib of Python {platform.python_version()}"
    return tokenize(corpus.split(docs, "heldout"), tok, plain_text), source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(TARGET_DIR))
    parser.add_argument("--draft", default=str(DRAFT_DIR))
    parser.add_argument("--corpus", default=str(CORPUS_PATH), help="falls back to this Python's stdlib")
    parser.add_argument("--windows", type=int, default=64, help="held-out windows of --seq-len tokens")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    ids, source = heldout_stream(tok, Path(args.corpus))
    stream = TokenStream(ids, args.seed)
    report, stats = measure_windows(target, draft, stream.windows(args.windows, args.seq_len), args.batch_size)
    prompts = stream.batch(args.prompts, args.prompt_len)  # [P, prompt_len], seeded offsets
    n_layers = target.config.num_hidden_layers
    report |= {
        "heldout_source": source,
        "expert_load": stats.load_report(),
        "temporal_locality": stats.mean("temporal_locality", range(n_layers)),
        "temporal_locality_chance": round(target.config.num_experts_per_tok / target.config.num_experts, 4),
        "next_layer_gate": stats.mean("next_layer_gate", range(n_layers - 1)),
        "draft_to_target_gate": stats.mean("draft_to_target_gate", range(n_layers)),
        "draft_target_residual_cosine": stats.mean("residual_cosine", range(n_layers)),
        "acceptance": {
            "ss_moe_top1_self_draft": acceptance(target, self_drafter(target), prompts, args.new_tokens, args.gamma),
            "external_dense_draft": acceptance(target, draft, prompts, args.new_tokens, args.gamma),
        },
        "settings": vars(args),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
