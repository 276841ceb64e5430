"""Real architectures as HF transformers (and timm, where it imports) build them: tiny random-init
configs, fp16, called as users call them. Each must capture, rewrite its heavy layers with none
reverted, keep the committed share of its FLOPs in accelc kernels, and match eager within the
dtype's rule."""
import copy
import warnings

import pytest
import torch

import accelc
from accelc.models.real import reinit
from accelc.numerics import rel_l2
from conftest import DEVICE, NORMS_REWRITTEN

transformers = pytest.importorskip("transformers")
T = transformers

DTYPE = torch.float16
TOL = 5e-3   # relative L2 of a whole fp16 model against eager: a few fp16 roundings per layer

_TEXT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, vocab_size=100)
# the causal LMs' position limit: optimize() also builds their generation step, whose static KV cache the
# limit sizes (the configs' defaults, 1024-8192 positions, made the step's attention, checked by the guard
# in Triton's interpreter, most of these tests' time: 175 of 214 s for Llama); test_generation.py tests the step
CACHE = 64
_VIT = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128, image_size=32,
            patch_size=8)


def _text(cls, cfg, seq=16):
    def make():
        torch.manual_seed(0)
        return reinit(cls(cfg)), (torch.randint(0, cfg.vocab_size, (2, seq), device=DEVICE),)
    return make


def _image(cls, cfg, size=32):
    def make():
        torch.manual_seed(0)
        return reinit(cls(cfg)), (torch.randn(2, 3, size, size, device=DEVICE, dtype=DTYPE),)
    return make


def _audio():
    def make():
        from transformers.models.whisper.modeling_whisper import WhisperEncoder
        torch.manual_seed(0)
        cfg = T.WhisperConfig(d_model=64, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=128,
                              num_mel_bins=16, max_source_positions=16, vocab_size=100, pad_token_id=0,
                              bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
        # (the encoder takes exactly 2 * max_source_positions frames)
        return reinit(WhisperEncoder(cfg)), (torch.randn(2, 16, 32, device=DEVICE, dtype=DTYPE),)
    return make


with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    FAMILIES = {
        # name: (builder, kernels that must appear, min FLOP coverage)
        "bert": (_text(T.BertModel, T.BertConfig(**_TEXT)), {"linear", "attention"}, 0.95),
        "roberta": (_text(T.RobertaModel, T.RobertaConfig(**_TEXT)), {"linear", "attention"}, 0.95),
        "distilbert": (_text(T.DistilBertModel, T.DistilBertConfig(dim=64, n_layers=2, n_heads=2, hidden_dim=128,
                                                                    vocab_size=100)), {"linear", "attention"}, 0.95),
        "gpt2": (_text(T.GPT2LMHeadModel, T.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=100,
                                                       n_positions=CACHE)),
                 {"linear", "attention"}, 0.95),
        "llama": (_text(T.LlamaForCausalLM, T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                          num_key_value_heads=2, intermediate_size=128,
                                                          vocab_size=100, max_position_embeddings=CACHE)),
                  # RoPE: one accelc::rotary_embedding for q and one for k, where the glue is eager
                  {"linear", "gated_linear"} | ({"rotary"} if NORMS_REWRITTEN else set()), 0.95),
        # RMSNorm as (h * (1 + w)) in fp32 then .type_as(x): accelc::rms_norm in fp16 too
        "gemma": (_text(T.GemmaForCausalLM, T.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                          num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                                          vocab_size=100, max_position_embeddings=CACHE)),
                  {"linear", "gated_linear"} | ({"rms_norm"} if NORMS_REWRITTEN else set()), 0.95),
        "t5_encoder": (_text(T.T5EncoderModel, T.T5Config(d_model=64, d_kv=32, d_ff=128, num_layers=2, num_heads=2,
                                                          vocab_size=100)), {"linear", "attention"}, 0.95),
        "vit": (_image(T.ViTModel, T.ViTConfig(**_VIT)), {"linear", "attention", "conv2d"}, 0.95),
        "deit": (_image(T.DeiTModel, T.DeiTConfig(**_VIT)), {"linear", "attention", "conv2d"}, 0.95),
        "resnet": (_image(T.ResNetModel, T.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])),
                   {"conv2d"}, 0.99),
        # depthwise convs: accelc::conv2d_depthwise (18% of this tiny ConvNeXt's FLOPs)
        "convnext": (_image(T.ConvNextModel, T.ConvNextConfig(hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
                     {"conv2d", "conv2d_depthwise", "linear"}, 0.99),
        "mobilenet_v2": (_image(T.MobileNetV2Model, T.MobileNetV2Config(depth_multiplier=0.25, image_size=32)),
                         {"conv2d", "conv2d_depthwise"}, 0.99),
        "efficientnet": (_image(T.EfficientNetModel, T.EfficientNetConfig(width_coefficient=0.1, depth_coefficient=0.1,
                                                                          image_size=32, hidden_dim=128)),
                         {"conv2d", "conv2d_depthwise"}, 0.99),
        # encoder-decoder whose layers end with HF's fp16 overflow guard (a branch on tensor values)
        "bart": (_text(T.BartModel, T.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                                                 decoder_attention_heads=2, encoder_ffn_dim=128, decoder_ffn_dim=128,
                                                 vocab_size=100, max_position_embeddings=64)),
                 {"linear", "attention"}, 0.95),
        # Conv1d stem (two convs + GELU: accelc::conv1d) before a transformer encoder
        "whisper_encoder": (_audio(), {"conv1d", "linear", "attention"}, 0.99),
    }


def _leaves(out):
    return [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_captures_and_rewrites(name):
    build, kinds, min_coverage = FAMILIES[name]
    model, args = build()
    model = model.to(DEVICE, DTYPE)
    opt = accelc.optimize(model, args)
    summary = opt.summary()
    assert not [r for r in opt.layers if r.status == "reverted"], summary
    got = {r.kind for r in opt.rewritten} | {r.kind.split("_")[0] for r in opt.rewritten}
    assert kinds <= got, summary
    coverage = opt.info.accelc_flops / opt.info.flops
    assert coverage >= min_coverage, summary
    with torch.no_grad():
        y, e = opt(*args), model(*args)
    assert type(y) is type(e)
    ys, es = _leaves(y), _leaves(e)
    assert len(ys) == len(es) > 0
    assert all(b.abs().max() > 0 for b in es)     # something to compare
    for a, b in zip(ys, es):
        assert a.shape == b.shape and rel_l2(a, b) < TOL, (name, rel_l2(a, b))
    if name in ("mobilenet_v2", "efficientnet"):     # on this optimize: an interpreted CNN's takes 40-110 s
        _tf_padding_and_activations_fold_into_the_convs(name, opt)


def _tf_padding_and_activations_fold_into_the_convs(name, opt):
    """HF's MobileNetV2 / EfficientNet pad explicitly (TF 'same' padding) and use ReLU6 / SiLU: each
    pad is folded into its conv's padding and each activation into its epilogue; nothing of the
    conv blocks stays PyTorch."""
    kept = [r for r in opt.layers if r.status == "kept" and r.kind in ("pad", "relu6", "hardtanh", "silu")]
    assert not kept, opt.summary()
    act = "relu6" if name == "mobilenet_v2" else "silu"
    assert any(r.kernel == f"accelc::conv2d_depthwise[{act}]" for r in opt.rewritten), opt.summary()
    assert any(r.kernel == f"accelc::conv2d[{act}]" for r in opt.rewritten), opt.summary()


def test_hf_cnn_batch_norms_are_folded():
    """torch.export keeps HF ResNet's batch norms as aten.batch_norm: folded like nn.BatchNorm2d."""
    model, args = FAMILIES["resnet"][0]()
    opt = accelc.optimize(model.to(DEVICE, DTYPE), args)
    assert opt.info.pass_counts["fold_bn"] == opt.info.pass_counts["conv_gemm"] > 0
    assert all("+" in r.name for r in opt.rewritten if r.kind == "conv2d")   # conv+bn(+act) layers


def test_keyword_inputs_and_a_cache_in_the_output():
    """GPT-2 as users call it: attention_mask by keyword (left padding: rows with no visible key),
    a DynamicCache in the output, returned as the model returns it."""
    model, (ids,) = FAMILIES["gpt2"][0]()
    model = model.to(DEVICE, DTYPE)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    opt = accelc.optimize(model, (ids,), example_kwargs={"attention_mask": mask})
    assert not [r for r in opt.layers if r.status == "reverted"], opt.summary()
    with torch.no_grad():
        y, e = opt(ids, attention_mask=mask), model(ids, attention_mask=mask)
        y2 = opt(ids, attention_mask=mask)
        ref = copy.deepcopy(model).float()(ids, attention_mask=mask)      # the higher-precision reference
    assert type(y) is type(e) and type(y.past_key_values) is type(e.past_key_values)
    # padded positions: eager's own fp16 error there is the yardstick
    assert rel_l2(y.logits, ref.logits) <= max(TOL, 2 * rel_l2(e.logits, ref.logits))
    for got, want in zip(y.past_key_values.layers, ref.past_key_values.layers):
        assert rel_l2(got.keys, want.keys) < TOL and rel_l2(got.values, want.values) < TOL
    assert y2.past_key_values is not y.past_key_values       # a fresh cache each call
    with torch.no_grad():     # left out, as GPT-2 allows: its default (every key visible), found at capture
        left, want = opt(ids), model(ids)
    assert opt.call_spec.fills == {"attention_mask": (1, "input_ids")}
    assert rel_l2(left.logits, want.logits) <= max(TOL, 2 * rel_l2(want.logits, ref.logits))
    with pytest.raises(accelc.errors.InputError, match="'token_type_ids' was not in the example"):
        opt(ids, attention_mask=mask, token_type_ids=mask)


def test_dict_inputs_and_fixed_keywords():
    """A tokenizer-style dict as the example (model(**inputs)), and use_cache=False fixed at
    capture: calling with another value says so."""
    model, (ids,) = FAMILIES["gpt2"][0]()
    model = model.to(DEVICE, DTYPE)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}
    opt = accelc.optimize(model, inputs)
    with torch.no_grad():
        y, e = opt(**inputs), model(**inputs)
    assert y.past_key_values is None and rel_l2(y.logits, e.logits) < TOL
    with pytest.raises(accelc.errors.InputError, match="use_cache=True: the model was optimized with use_cache=False"):
        opt(**{**inputs, "use_cache": True})


timm = None
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import timm
except Exception:   # timm needs torchvision, which has no CPU build for every torch
    timm = None

TIMM = {
    "vit": (dict(model_name="vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), {"linear", "attention"}, 0.95),
    "resnet": (dict(model_name="resnet18"), {"conv2d"}, 0.99),
    "convnext": (dict(model_name="convnext_atto", depths=(1, 1, 1, 1)), {"conv2d", "conv2d_depthwise", "linear"}, 0.99),
    # BatchNormAct2d after every conv, grouped 3x3 convs (8 channels a group), squeeze-excitation
    "regnety": (dict(model_name="regnety_002"), {"conv2d", "linear"}, 0.99),
}


@pytest.mark.skipif(timm is None, reason="timm does not import here (it needs torchvision)")
@pytest.mark.parametrize("name", list(TIMM))
def test_timm_family(name):
    kw, kinds, min_coverage = TIMM[name]
    torch.manual_seed(0)
    model = timm.create_model(pretrained=False, **kw).eval().to(DEVICE, DTYPE)
    x = torch.randn(2, 3, 32, 32, device=DEVICE, dtype=DTYPE)
    opt = accelc.optimize(model, (x,))
    assert not [r for r in opt.layers if r.status == "reverted"], opt.summary()
    assert kinds <= {r.kind for r in opt.rewritten} | {r.kind.split("_")[0] for r in opt.rewritten}, opt.summary()
    assert opt.info.accelc_flops / opt.info.flops >= min_coverage, opt.summary()
    with torch.no_grad():
        assert rel_l2(opt(x), model(x)) < TOL
