"""SASS digests of the Gluon candidates for sm90, built without a GPU (bench/gluon_compile.py's builds, each
candidate's SASS with its addresses taken out, hashed):

    TRITON_INTERPRET=0 python bench/results/runs/gluon-aggregates/sass_hash.py gemm|w8a8|fp8|conv|attention
"""
import hashlib, json, os, re, sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3]))   # bench/
import gluon_compile as gc

def _usage(compiled):
    sass, usage = gc.sass_and_usage(compiled)
    body = "\n".join(re.sub(r"/\*[0-9a-f]{4,}\*/", "", l).strip() for l in sass.splitlines()
                     if l.strip() and not l.strip().startswith(("Fatbin", "code for", "Function", ".section", "arch", "code version", "host", "compile_size")))
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"sha": hashlib.sha256(body.encode()).hexdigest()[:16], "lines": body.count("\n"),
            "registers": int(found.group(1)) if found else None}
gc._usage = _usage
kernel = sys.argv[1]
sys.argv = ["gluon_compile.py", "--kernel", kernel, "--json"]
sys.exit(gc.main())
