"""The newest transformers the bounds admit (CI resolves it; the device runs the lowest, 5.17): from 5.24 it imports
Hugging Face's `kernels` package as it loads any model, which the repository's own top-level `kernels/` folder
shadowed wherever the root is on sys.path; and it renamed the KV cache's keyword (`past_key_values` -> `cache`), which
HF's generate loop passes to the step's shell."""
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import accelc

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_hf_models_load_from_the_repository_root():
    """`python -c` from the root puts it first on sys.path, as `python -m pytest` and a notebook there do. With HF's
    `kernels` installed the name is that package; without it (the device's image) the folder's empty module."""
    code = ("import sys, transformers as tf\n"
            "m = tf.LlamaForCausalLM(tf.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,\n"
            "    num_attention_heads=4, vocab_size=50))\n"
            "import importlib.metadata as md, kernels, accelc.kernels as k\n"
            "try:\n    md.version('kernels'); installed = True\n"
            "except md.PackageNotFoundError:\n    installed = False\n"
            f"mine = kernels.__file__.startswith({str(ROOT / 'kernels')!r})\n"
            "assert not mine if installed else not hasattr(kernels, 'LAUNCHERS'), kernels.__file__\n"
            "assert k.LAUNCHERS and k.__name__ == 'accelc.kernels'\n"
            "print('ok', sys.path[0] == '')")
    done = _run(code)
    assert done.returncode == 0 and "ok True" in done.stdout, done.stderr[-3000:]


def test_without_a_kernels_package_the_name_is_an_empty_module_without_a_version():
    """-S: no site-packages, so no installed `kernels`. transformers before 5.24 (the device's 5.17) finds this folder
    by the name, imports it to read a version, and takes a package without one for none installed: the folder gives
    an empty module (an ImportError there had stopped every model's import; accelc's own tables there imported
    accelc into a process that only loaded a model)."""
    done = _run("import sys; sys.path.insert(0, '.')\n"
                "import importlib, importlib.util\n"
                "assert importlib.util.find_spec('kernels') is not None\n"
                "k = importlib.import_module('kernels')\n"
                "print('version', getattr(k, '__version__', 'N/A'), 'tables', hasattr(k, 'LAUNCHERS'),"
                " 'accelc', 'accelc' in sys.modules)\n", "-S")
    assert done.returncode == 0 and "version N/A tables False accelc False" in done.stdout, (done.stdout,
                                                                                           done.stderr[-2000:])


def test_hf_loop_generate_without_deprecated_keywords(monkeypatch):
    """Sampling and a logits processor run HF's own loop over the step's shell: the same tokens as HF, and accelc
    passes the cache under the model's own keyword (no deprecation warning of its making: HF says its own through
    its logger, once a process, or through warnings)."""
    tf = pytest.importorskip("transformers")
    from transformers.utils import generic
    logged = []
    if hasattr(generic, "logger"):
        monkeypatch.setattr(generic.logger, "warning_once", lambda msg, *a, **k: logged.append(msg), raising=False)
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100, max_position_embeddings=64)
    lm = tf.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (1, 6))
    p = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    opt = accelc.optimize(lm, p)
    for kw in (dict(do_sample=True, top_k=5), dict(do_sample=False, repetition_penalty=1.3)):
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            torch.manual_seed(1)
            got = opt.generate(**p, max_new_tokens=5, pad_token_id=0, **kw)
        assert opt.last_loop == "hf", kw
        torch.manual_seed(1)
        assert torch.equal(got, lm.generate(**p, max_new_tokens=5, pad_token_id=0, **kw)), kw
        said = [str(w.message) for w in said] + logged
        assert not [w for w in said if "past_key_values" in w], said
