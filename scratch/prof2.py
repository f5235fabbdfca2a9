"""Scratch: host cost of one graphed draft launch, piece by piece (not committed)."""
import sys, time, json
from collections import defaultdict
from dataclasses import replace
sys.path.insert(0, ".")
import torch
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.decode import PendingLogits
from engine.graphs import _Key, span_bucket

cfg = EngineConfig(model="models/default", device="cuda", max_model_len=1024, draft="models/default-draft", spec="draft", spec_tokens=8, gpu_expert_budget="50%", spec_cutoff=0)
core = EngineCore(cfg)
drafter = core.runtime.decoder.drafter
bm = drafter.model
g = bm.graphs
bm.forward(list(range(10, 74)))
L = bm.kv.length
for _ in range(3):
    bm.forward([5], last_only=True); bm.kv.length = L
key = next(k for k in g.graphs if k.tokens == 1)
cap = g.graphs[key]
acc = defaultdict(float)
N = 300
def clock(name, t):
    now = time.perf_counter(); acc[name] += now - t; return now
for mode in ("synced", "free"):
    acc.clear()
    for i in range(N):
        if mode == "synced":
            torch.cuda.synchronize()
        t = time.perf_counter()
        pos = bm.kv.length
        k = _Key(span_bucket(pos + 1, bm.kv.max_len), None, 1, None); t = clock("key", t)
        inputs = torch.tensor([[5], [pos]], pin_memory=True); t = clock("pinned_tensor", t)
        inputs2 = torch.tensor([[5], [pos]]); t = clock("plain_tensor", t)
        cap.inputs.copy_(inputs, non_blocking=True); t = clock("input_copy", t)
        cap.segments[-1].replay(); t = clock("graph_replay", t)
        p = PendingLogits(cap.logits[-1:]); t = clock("pending_logits", t)
        r = p.result(); t = clock("result_wait", t)
        x = cap.logits[-1:].float().cpu(); t = clock("plain_cpu_read", t)
        q = torch.nn.functional.one_hot(r[-1].argmax(), r.shape[-1]).to(torch.float32); t = clock("one_hot_argmax", t)
        bm.kv.length = L
    print(mode, {k: round(v / N * 1e6, 1) for k, v in acc.items()}, flush=True)
# whole BoundModel.launch + result, synced and free-running
for mode in ("synced", "free"):
    torch.cuda.synchronize(); t = time.perf_counter(); tl = 0.0
    for i in range(N):
        if mode == "synced":
            torch.cuda.synchronize()
        a = time.perf_counter()
        p = drafter.launch(list(range(L + 1)))
        tl += time.perf_counter() - a
        p.result(); bm.kv.length = L
    torch.cuda.synchronize()
    print(mode, "launch us", round(tl / N * 1e6, 1), "launch+result us", round((time.perf_counter() - t) / N * 1e6, 1), flush=True)
# GPU time of one replay, by events
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
torch.cuda.synchronize(); s.record()
for i in range(N):
    cap.segments[-1].replay()
e.record(); torch.cuda.synchronize()
print("gpu replay us", round(s.elapsed_time(e) / N * 1e3, 1), "kernels?", flush=True)
core.close()
from torch.profiler import profile, ProfilerActivity
core = EngineCore(cfg)
drafter = core.runtime.decoder.drafter
bm = drafter.model
bm.forward(list(range(10, 74)))
L = bm.kv.length
for _ in range(3):
    bm.forward([5], last_only=True); bm.kv.length = L
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
    for _ in range(10):
        drafter.launch(list(range(L + 1))).result(); bm.kv.length = L
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40), flush=True)
core.close()
