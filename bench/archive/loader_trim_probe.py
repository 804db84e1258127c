#!/usr/bin/env python3
"""Why the streamed loader's RSS grows with depth: heap retention, not a leak (figure 1 note).

Runs the patched trainer's load_blockwise + quantize_transformer_block (CPU, uint4) on a
checkpoint written by loader_rss.write_checkpoint, and prints the RSS after the last block next
to the size of the quantized state it keeps. --release also calls gc.collect() and glibc's
malloc_trim(0) after each block (Linux only). One size per process:

    <venv>/bin/python -m bench.archive.loader_trim_probe --trainer <checkout> --size 1536:4:24 [--release]
"""

import argparse
import ctypes
import gc
import importlib
import json
import tempfile
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--trainer", required=True, type=Path)
p.add_argument("--size", default="1536:4:24", help="hidden:double:single")
p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "loader_trim_probe",
               help="where the checkpoint is written and kept between runs (default: in the temp dir)")
p.add_argument("--release", action="store_true", help="gc.collect() + malloc_trim(0) after each block")
args = p.parse_args()

import torch  # noqa: E402

from bench import _trainer as T  # noqa: E402
from bench import loader_rss  # noqa: E402  (its checkpoint writer and size parsing)

GiB = 2**30
tr = T.Trainer(args.trainer)
params = loader_rss.flux2_params(args.size)
args.dir.mkdir(parents=True, exist_ok=True)
path = args.dir / f"flux2-{args.size.replace(':', 'x')}.safetensors"
if not path.is_file():
    loader_rss.write_checkpoint(loader_rss.import_trainer(tr.root), params, path)
q = tr.quantize
qt = q.get_qtype("uint4")
stub = T.BaseModelStub("cpu")
libc = ctypes.CDLL("libc.so.6") if args.release else None
with torch.device("meta"):
    model = tr.model.Flux2(tr.model.Flux2Params(**params))
gc.collect()
base = T.proc_status()


def on_block(prefix, block):
    q.quantize_transformer_block(stub, block, qt, torch.device("cpu"), name=prefix)
    if libc is not None:
        gc.collect()
        libc.malloc_trim(0)


tr.streamed.load_blockwise(model, path, T.BLOCK_LISTS, on_block=on_block,
                           on_rest=lambda m: q.quantize_extras(stub, m, qt), dtype=torch.bfloat16,
                           log=lambda m: None)
gc.collect()
end = T.proc_status()
kept = 0
codecs = importlib.import_module("toolkit.qcache_codecs")
allowed = codecs._torchao_classes()
for _, t, _, _ in codecs._named_state(model):
    leaves = {}
    codecs._flatten(t, "x", leaves, allowed)
    kept += sum(v.numel() * v.element_size() for v in leaves.values())
print(json.dumps({
    "size": args.size, "release": args.release, "file_gib": path.stat().st_size / GiB,
    "quantized_state_gib": kept / GiB, "rss_end_gib": (end["VmRSS"] - base["VmRSS"]) / GiB,
    "rss_peak_gib": (end["VmHWM"] - base["VmRSS"]) / GiB,
}))
