"""Why a cold LM's padding check waits on compiles in its padded calls (py-spy, next14.sh prof: 5.9 s of the
Qwen2-0.5B batch-1 LM's cold optimize under buckets._inert's `big = fn(padded)`) though `before` handed that size's
candidates to the compile workers first: a small Qwen2 (2 layers, fp16) optimized as a plain model on the GPU,
each tuner's choice printed with what it was inside (collecting / serving), each hand-over with its job count,
and the padding check's start and end. A diagnosis, not a benchmark."""
import sys
import time
import warnings

import torch
import transformers as T

import accelc
from accelc import buckets, compile_workers, layer_compiles, tuning

T0 = time.perf_counter()


def say(*a):
    print(f"{time.perf_counter() - T0:7.2f}", *a, flush=True)


choose = tuning.Tuner._choose


def traced_choose(self, key, sizes, launch):
    mode = "collecting" if tuning._collecting.get() is not None else ("serving" if tuning._serving.get() else "plain")
    t = time.perf_counter()
    cfg = choose(self, key, sizes, launch)
    say(f"choose {self.name} {[str(k) for k in key][:4]} {mode} {time.perf_counter() - t:.2f}s")
    return cfg


tuning.Tuner._choose = traced_choose
submit = compile_workers.submit


def traced_submit(jobs):
    p = submit(jobs)
    say(f"submit {len(jobs)} jobs -> {len(p._todo) + 0} queued")
    return p


compile_workers.submit = traced_submit
find = buckets.find


def traced_find(*a, **kw):
    say("padding check begins")
    out = find(*a, **kw)
    say("padding check ends", out[1][:100])
    return out


buckets.find = traced_find
ahead = layer_compiles.candidates_ahead


def traced_ahead(gm, args, only):
    say("candidates_ahead", [tuple(x.shape) for x in args if isinstance(x, torch.Tensor)], "active",
        compile_workers.active())
    return ahead(gm, args, only)


layer_compiles.candidates_ahead = traced_ahead


class Logits(torch.nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(ids, use_cache=False).logits


cfg = T.Qwen2Config(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
                    num_attention_heads=8, num_key_value_heads=2)
torch.manual_seed(0)
model = Logits(T.Qwen2ForCausalLM(cfg)).cuda().half().eval()
ids = torch.randint(0, 4096, (1, int(sys.argv[1]) if len(sys.argv) > 1 else 128), device="cuda")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    opt = accelc.optimize(model, (ids,))
say("done", opt.info.seconds)
