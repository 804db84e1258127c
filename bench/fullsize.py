#!/usr/bin/env python3
"""Full-size runs through `python -m launcher run` on a GPU machine that has no network.

Three steps, each a subcommand:

  pack     (here, with network) the trainer's packages that the GPU machine's Python lacks or has
           at another version, installed for CPython 3.12 into one tree and packed, plus the
           patched checkout's files:  .bench-carry/site.tar.xz, .bench-carry/trainer.tar.xz
  prepare  (there) a workdir R/wd whose venv is made from that machine's Python and sees its
           site-packages after the packed tree (a .pth file), a VRAM cap applied in every
           process of the venv (BENCH_VRAM_CAP_GIB, another .pth line), and random-weight
           assets: the FLUX.2 transformer (about 60 GiB at full depth; --single-blocks fewer)
           and the real VAE shape in --model-dir (a disk), a Mistral3 text encoder of the real
           Mistral-Small-3.1 text shape (44 GiB; --te-mlp narrows its MLP) and a captioned
           dataset in R/assets (R may be a RAM disk); --model klein4b or klein9b: FLUX.2 klein's
           transformer (the trainer's Klein4BParams / Klein9BParams, 7.2 / 17 GiB) and its Qwen3-4B /
           Qwen3-8B encoder (7.5 / 15 GiB) in their real shapes instead
  launch   (there) one `launcher run` of a preset with the steps cut short, while the trainer's
           host memory is sampled every 0.2 s; one JSON object of figures. Refused before it
           starts where a dataset's resolution is above the images `prepare` made (--image-size)

    python -m bench.fullsize pack --workdir W --image-freeze FREEZE.txt
    python3 -m bench.fullsize prepare --carry .bench-carry --root R
    python3 -m bench.fullsize prepare --carry .bench-carry --root R --model klein9b
    python3 -m bench.fullsize launch --root R --preset presets/rtx4090_512.yaml --label first --steps 6

FREEZE.txt is `python -m pip list --format=freeze` run with the GPU machine's Python. Random
weights give meaningless images and losses; memory, load times and step times are real.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from bench._children import descendants

REPO = Path(__file__).resolve().parents[1]

# The GPU machine provides these itself; packing them would add gigabytes.
PROVIDED = ("torch==", "torchvision==", "torchaudio==", "triton==", "nvidia-", "cuda-", "cupy")
# Imported by a FLUX.2 LoRA run: what the probe below imports in the trainer's venv.
TRAINER_ENTRY_MODULES = ("run", "toolkit.job", "jobs.process.BaseSDTrainProcess",
                         "extensions_built_in.sd_trainer.SDTrainer",
                         "extensions_built_in.diffusion_models.flux2.flux2_model")
IMPORT_PROBE = """
import importlib, importlib.metadata as md, json, sys
sys.path.insert(0, sys.argv[1])
for name in sys.argv[2:]:
    importlib.import_module(name)
importlib.import_module("toolkit.extension").get_all_extensions_process_dict()  # imports every extension
found = md.packages_distributions()
print(json.dumps(sorted({d.lower().replace("_", "-") for m in list(sys.modules) for d in found.get(m.split(".")[0], [])})))
"""
# Twins that install the same module: the machine's one serves (opencv-python is 60 MB).
TWINS = {"opencv-python": "opencv-python-headless"}
# Where the trainer's pin must win over the machine's own version.
TRAINER_PINS = ("transformers", "tokenizers", "huggingface-hub", "diffusers")
# The launcher's own dependencies, which the trainer venv does not list.
LAUNCHER_PACKAGES = ("GitPython", "gitdb", "smmap")
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                   "manylinux2014_x86_64", "linux_x86_64", "any")
# Real Mistral-Small-3.1-24B text shape (--te-mlp narrows its 32768-wide MLP for a small disk).
TEXT_SHAPE = {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 32768,
              "vocab_size": 131072, "max_position_embeddings": 131072, "rope_theta": 1e9}
# klein's encoders: the text shapes of config.json of https://huggingface.co/Qwen/Qwen3-8B and
# https://huggingface.co/Qwen/Qwen3-4B
QWEN3_SHAPES = {
    "klein9b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "klein4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
                "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
                "rope_theta": 1000000, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
}
KLEIN_ARCH = {"klein4b": "flux2_klein_4b", "klein9b": "flux2_klein_9b"}
SHARD_BYTES = 5 * 2**30
REAL_AE = {"resolution": 256, "in_channels": 3, "ch": 128, "out_ch": 3, "ch_mult": [1, 2, 4, 4],
           "num_res_blocks": 2, "z_channels": 32}
GIB = 2**30


def freeze(python: Path) -> dict[str, str]:
    lines = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], capture_output=True,
                           text=True, check=True).stdout
    return parse_freeze(lines)


def parse_freeze(text: str) -> dict[str, str]:
    pins = {}
    for line in text.splitlines():
        if "==" in line:
            name, version = line.split("==", 1)
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def imported_distributions(python: Path, trainer: Path) -> set[str]:
    """The distributions a FLUX.2 run imports, read by importing its entry modules in the venv."""
    done = subprocess.run([str(python), "-c", IMPORT_PROBE, str(trainer), *TRAINER_ENTRY_MODULES],
                          capture_output=True, text=True, check=True, cwd=trainer)
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def packages_to_carry(trainer: dict[str, str], image: dict[str, str], imported: set[str]) -> list[str]:
    """name==version for what a run imports and the image lacks (or pins differently)."""
    wanted = [f"{name}=={version}" for name, version in sorted(trainer.items())
              if name in imported and not f"{name}==".startswith(PROVIDED) and TWINS.get(name) not in image
              and (name not in image or (name in TRAINER_PINS and image[name] != version))]
    return wanted + [name for name in LAUNCHER_PACKAGES if name.lower() not in trainer]


def pack(args) -> int:
    from launcher.envs.workdir import Workdir

    workdir = Workdir(args.workdir.resolve())
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.trainer_only:
        pack_site(workdir, args.image_freeze, args.out, args.stub or [])
    pack_trainer(workdir, args.out)
    for name in ("trainer.tar.xz",) if args.trainer_only else ("site.tar.xz", "trainer.tar.xz"):
        print(f"{args.out / name}: {(args.out / name).stat().st_size / 2**20:.1f} MiB", flush=True)
    return 0


def pack_site(workdir, image_freeze: Path, out: Path, stubs: list[str]) -> None:
    """The packages a run imports that the GPU machine lacks, installed for cp312, as one archive;
    each module of `stubs` an importable stand-in instead (stub())."""
    from launcher.envs.workdir import venv_python

    python = venv_python(workdir.venv)
    wanted = packages_to_carry(freeze(python), parse_freeze(image_freeze.read_text(encoding="utf-8")),
                               imported_distributions(python, workdir.trainer))
    site_dir = next(workdir.venv.glob("lib/python3*/site-packages")).resolve()  # copy_installed compares resolved paths
    from_git = vcs_installed(site_dir)
    with tempfile.TemporaryDirectory() as scratch:
        tree = Path(scratch) / "site"
        platforms = [arg for platform in WHEEL_PLATFORMS for arg in ("--platform", platform)]
        from_index = [spec for spec in wanted if spec.split("==")[0] not in from_git]
        print(f"installing {len(from_index)} packages for cp312 into a tree", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tree),
                        "--python-version", "3.12", "--implementation", "cp", *platforms, *from_index], check=True)
        for name, dist in from_git.items():
            if any(spec.split("==")[0] == name for spec in wanted):
                copy_installed(dist, site_dir, tree)
        slim(tree)
        for name in stubs:
            stub(tree, name)
        write_tar(out / "site.tar.xz", tree, "site")


def pack_trainer(workdir, out: Path) -> None:
    """The patched checkout's tracked files and the setup state (no .git: a run never needs it)."""
    files = subprocess.run(["git", "-C", str(workdir.trainer), "ls-files", "-z"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    with tarfile.open(out / "trainer.tar.xz", "w:xz") as archive:
        for name in filter(None, files):
            if (workdir.trainer / name).is_file():
                archive.add(workdir.trainer / name, arcname=f"trainer/{name}")
        archive.add(workdir.state_file, arcname=workdir.state_file.name)


def vcs_installed(site_dir: Path) -> dict:
    """{normalised name: distribution} of packages installed from a git URL (no index has them)."""
    from importlib.metadata import distributions

    found = {}
    for dist in distributions(path=[str(site_dir)]):
        origin = dist.read_text("direct_url.json")
        if origin and "vcs_info" in json.loads(origin):
            found[dist.metadata["Name"].lower().replace("_", "-")] = dist
    return found


def copy_installed(dist, site_dir: Path, tree: Path) -> None:
    """Copy a pure-Python distribution's installed files as they are."""
    for file in dist.files or []:
        source = (site_dir / file).resolve()
        if source.is_file() and site_dir in source.parents and "__pycache__" not in file.parts:
            target = tree / file
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def slim(tree: Path) -> None:
    """Drop what a CUDA 13 run never loads: other bitsandbytes libraries, wandb's service binaries."""
    for library in (tree / "bitsandbytes").glob("libbitsandbytes_*"):
        if "cuda130" not in library.name:
            library.unlink()
    shutil.rmtree(tree / "wandb" / "bin", ignore_errors=True)


def stub(tree: Path, module: str) -> None:
    """Replace a package that a run imports but never calls with a module that says so when used:
    the trainer's data loader imports PyAV (with its 80 MB of FFmpeg libraries) for video
    datasets only, and the whole carry to a GPU machine may be limited in size."""
    for name in (module, f"{module}.libs"):
        shutil.rmtree(tree / name, ignore_errors=True)
    (tree / module).mkdir()
    (tree / module / "__init__.py").write_text(
        '"""A stand-in packed by bench/fullsize.py (pack --stub): this run never calls the package."""\n\n\n'
        "def __getattr__(name):\n"
        "    if name.startswith('__'):\n"
        "        raise AttributeError(name)\n"
        f"    raise ImportError(f'{module}.{{name}}: {module} was packed as a stub (bench/fullsize.py pack --stub {module})')\n",
        encoding="utf-8")


def write_tar(path: Path, folder: Path, arcname: str) -> None:
    with tarfile.open(path, "w:xz") as archive:
        archive.add(folder, arcname=arcname)


def prepare(args) -> int:
    root = args.root.resolve()
    (root / "wd").mkdir(parents=True, exist_ok=True)
    for name, dest in (("site.tar.xz", root), ("trainer.tar.xz", root / "wd")):
        with tarfile.open(args.carry / name) as archive:
            archive.extractall(dest, filter="tar")
    for wheel in sorted(args.carry.glob("wheels/*.whl")):  # late additions, without repacking
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                        str(root / "site"), str(wheel)], check=True)
    make_venv(root)
    sys.path.insert(0, str(root / "site"))  # the trainer's transformers writes the text encoder
    model_dir = (args.model_dir or root / "assets").resolve()
    timed("assets", lambda: build_assets(root / "wd" / "trainer", root / "assets", model_dir, args))
    return 0


def make_venv(root: Path) -> None:
    """A venv of this Python that sees the packed tree first, then this Python's own packages, and
    caps VRAM in every process it starts when BENCH_VRAM_CAP_GIB is set.

    The cap is a `.pth` line starting with `import`: a venv's sitecustomize.py is shadowed by the
    machine image's own and silently does nothing there."""
    import site

    venv = root / "wd" / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = next(venv.glob("lib/python3*/site-packages"))
    (packages / "carry.pth").write_text("\n".join([str(root / "site"), *site.getsitepackages()]) + "\n")
    (packages / "bench_vram_cap.py").write_text(VRAM_CAP_MODULE)
    # named to sort after carry.pth, which puts torch on the path: .pth files run in name order
    (packages / "zz_bench_vram_cap.pth").write_text(
        "import os; os.environ.get('BENCH_VRAM_CAP_GIB') and __import__('bench_vram_cap').apply()\n")


VRAM_CAP_MODULE = '''"""The benchmark's VRAM cap: a large GPU behaves as a card of BENCH_VRAM_CAP_GIB."""
import os
import sys


def apply():
    """Queued for CUDA's lazy initialisation: a process that never uses the GPU never starts it."""
    import torch

    torch.cuda._lazy_call(_cap)


def _cap():
    import torch

    cap = float(os.environ["BENCH_VRAM_CAP_GIB"]) * 2**30
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(cap / total, 1.0))
    # stderr: the launcher reads some of the venv's stdout as JSON
    print(f"[bench] VRAM capped at {cap / 2**30:.1f} GiB of {total / 2**30:.1f}", file=sys.stderr, flush=True)
'''


def check_cap(root: Path, cap_gib: float) -> None:
    """Prove the cap is applied in the venv: an allocation just above it must fail."""
    probe = ("import torch\n"
             f"n = int(({cap_gib} + 0.5) * 2**30)\n"
             "try:\n    torch.empty(n, dtype=torch.uint8, device='cuda')\nexcept torch.OutOfMemoryError:\n"
             "    print('[bench] an allocation above the cap failed, as it must')\nelse:\n"
             "    raise SystemExit('the VRAM cap is not applied')\n")
    python = next((root / "wd" / "venv" / "bin").glob("python3"))
    subprocess.run([str(python), "-c", probe], check=True, env={**os.environ, "BENCH_VRAM_CAP_GIB": str(cap_gib)})


def build_assets(trainer: Path, out: Path, model_dir: Path, args) -> None:
    """The transformer and VAE files into `model_dir` (a disk, for their size), the text encoder
    and the dataset into `out` (which may be a RAM disk)."""
    from launcher.in_trainer import tiny_assets

    out.mkdir(parents=True, exist_ok=True)
    model_dir.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(trainer))
    from extensions_built_in.diffusion_models.flux2.src.autoencoder import AutoEncoder, AutoEncoderParams
    from extensions_built_in.diffusion_models.flux2.src.model import Flux2, Flux2Params

    if args.model == "flux2":
        transformer = meta_shapes(Flux2, Flux2Params(depth_single_blocks=args.single_blocks or 48, **args.flux2_shape))
        timed("transformer", lambda: write_random_checkpoint(transformer, model_dir / "flux2-dev.safetensors"))
    else:
        build_klein_transformer(args, model_dir)
    vae = meta_shapes(AutoEncoder, AutoEncoderParams(**REAL_AE))
    timed("vae", lambda: write_random_checkpoint(vae, model_dir / "ae.safetensors"))
    folder = out / tiny_assets.TEXT_ENCODER_DIR
    if args.model == "flux2":
        shape = {**TEXT_SHAPE, "intermediate_size": args.te_mlp or TEXT_SHAPE["intermediate_size"], **args.te_shape}
        timed("text encoder", lambda: build_text_encoder(folder, shape))
    else:
        shape = {**QWEN3_SHAPES[args.model], **({"intermediate_size": args.te_mlp} if args.te_mlp else {}), **args.te_shape}
        timed("text encoder", lambda: build_qwen3_encoder(folder, shape))
    tiny_assets.build_dataset(out, seed=0, size=args.image_size, count=args.images)
    (out / PREPARED).write_text(json.dumps({"image_size": args.image_size}) + "\n", encoding="utf-8")


PREPARED = "prepared.json"
"""What `prepare` made in R/assets, for `launch` to check against: the dataset's image size."""


def too_large(assets: Path, process: dict) -> str | None:
    """Why a launch would not train at its resolution: one above the prepared images' size, which the
    trainer would train at the images' own size, unlike the plan and the label. None where it can."""
    from launcher.runs.memory_plan import resolutions

    try:
        size = json.loads((assets / PREPARED).read_text(encoding="utf-8"))["image_size"]
    except FileNotFoundError:
        return None  # assets of a prepare before this check
    except (ValueError, KeyError, TypeError) as error:
        return f"{assets / PREPARED} is not what `prepare` writes ({error!r}): prepare again"
    largest = max(resolutions(process), default=0)
    if largest > size:
        return (f"resolution {largest} is above the {size} px images `prepare` made in {assets}: "
                f"prepare again with --image-size {largest}")
    return None


def build_klein_transformer(args, model_dir: Path) -> None:
    """klein's transformer from the trainer's own Klein4BParams / Klein9BParams, under the file name
    the trainer looks for (flux2_contract/families.py)."""
    import dataclasses

    from extensions_built_in.diffusion_models.flux2.src import model as flux2_model
    from extensions_built_in.diffusion_models.flux2.src.model import Flux2

    from flux2_contract.families import FAMILIES

    params = getattr(flux2_model, f"Klein{args.model.removeprefix('klein').upper()}Params")()
    if args.single_blocks:
        params = dataclasses.replace(params, depth_single_blocks=args.single_blocks)
    params = dataclasses.replace(params, **args.flux2_shape)
    transformer = meta_shapes(Flux2, params)
    path = model_dir / FAMILIES[KLEIN_ARCH[args.model]].transformer_file
    timed("transformer", lambda: write_random_checkpoint(transformer, path))


def meta_shapes(module_class, *params) -> dict:
    import torch

    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in module_class(*params).state_dict().items()}


def build_text_encoder(folder: Path, shape: dict) -> None:
    """A Mistral3 from_pretrained folder of the given text shape, written shard by shard from
    random tensors: building the 24B model in host memory first would need ~90 GiB in fp32."""
    from transformers import Mistral3ForConditionalGeneration

    from launcher.in_trainer import tiny_assets

    tokenizer = tiny_assets.build_tokenizer()
    tiny_assets.save_processor(folder, tokenizer)
    config = tiny_assets.text_encoder_config(tokenizer, **shape)
    config.save_pretrained(folder)
    write_sharded(folder, meta_shapes(Mistral3ForConditionalGeneration, config))


def build_qwen3_encoder(folder: Path, shape: dict) -> None:
    """A Qwen3ForCausalLM folder of the given shape with the tiny klein's byte-level tokenizer (its
    token ids stay far below any vocab size), written shard by shard from random tensors."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from launcher.in_trainer import tiny_assets

    tiny_assets.build_qwen3_encoder(folder, seed=0)  # the tokenizer, and the special token ids of its config
    for path in folder.glob("*.safetensors"):
        path.unlink()
    tiny = Qwen3Config.from_pretrained(folder)
    config = Qwen3Config(**shape, pad_token_id=tiny.pad_token_id, eos_token_id=tiny.eos_token_id)
    config.save_pretrained(folder)
    write_sharded(folder, meta_shapes(Qwen3ForCausalLM, config))


def write_sharded(folder: Path, shapes: dict) -> None:
    """Random bf16 tensors of `shapes` as from_pretrained shards of SHARD_BYTES at most, with their index."""
    shards, current, size = [], {}, 0
    for name, tensor_shape in shapes.items():
        nbytes = 2 * math.prod(tensor_shape)
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor_shape
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for index, shard in enumerate(shards, start=1):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        total += write_random_checkpoint(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def write_random_checkpoint(shapes: dict, path: Path) -> int:
    """A bf16 safetensors file of the given tensor shapes, written tensor by tensor (GPU if there
    is one); returns its data size.

    Matrices are N(0, 0.02), norm scales ones, other vectors zeros: finite activations, so the
    loss is a number, which is all a benchmark needs.
    """
    import torch

    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 2 * int(torch.Size(shape).numel())
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(device).manual_seed(0)
    with path.open("wb") as stream:
        stream.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape in shapes.items():
            if len(shape) >= 2:
                tensor = torch.randn(shape, generator=generator, device=device, dtype=torch.bfloat16) * 0.02
            else:
                fill = 1.0 if "scale" in name or "norm" in name else 0.0
                tensor = torch.full(shape, fill, device=device, dtype=torch.bfloat16)
            stream.write(tensor.cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    print(f"  {path.name}: {offset / GIB:.2f} GiB, {len(shapes)} tensors", flush=True)
    return offset


def timed(label: str, work) -> None:
    started = time.monotonic()
    work()
    print(f"{label}: {time.monotonic() - started:.1f} s", flush=True)


def launch(args) -> int:
    import yaml

    from launcher.runs.presets import read_preset

    root = args.root.resolve()
    preset = read_preset(str(args.preset)).data  # laid over the presets it inherits: written out whole below
    process = preset["config"]["process"][0]
    process["train"]["steps"] = args.steps
    process["save"]["save_every"] = args.steps + 1000
    for key, value in (args.set or []):
        target = process
        *path, last = key.split(".")
        for part in path:  # a number indexes a list: datasets.0.resolution
            target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
        target[last] = yaml.safe_load(value)
    for key, value in (args.launcher_set or []):
        preset.setdefault("launcher", {})[key] = yaml.safe_load(value)
    why = too_large(root / "assets", process)
    if why:
        print(f"bench.fullsize launch {args.label}: {why}", file=sys.stderr)
        return 2
    short = root / "presets" / f"{args.label}.yaml"
    short.parent.mkdir(parents=True, exist_ok=True)
    short.write_text(yaml.safe_dump(preset, sort_keys=False), encoding="utf-8")
    assets, output = root / "assets", root / "runs" / args.label
    command = [sys.executable, "-m", "launcher", "run", str(short), "--workdir", str(root / "wd"),
               "--model-dir", str(args.model_dir or assets), "--text-encoder", str(assets / "text_encoder"),
               "--dataset", str(assets / "dataset"), "--output", str(output)]
    if args.profile:
        command += ["--profile", str(args.profile)]
    env = {**os.environ, "PYTHONPATH": str(root / "site"), "BENCH_VRAM_CAP_GIB": str(args.cap_gib) if args.cap_gib else ""}
    if args.cap_gib:
        check_cap(root, args.cap_gib)
    started = time.time()
    launcher = subprocess.Popen(command, cwd=REPO, env=env)
    peak = sample_peak_rss(launcher)
    wall = time.time() - started
    result = {"label": args.label, "preset": str(args.preset), "rc": launcher.returncode, "wall_s": round(wall, 1),
              "cap_gib": args.cap_gib, "trainer_anon_parts_gib": peak.pop("anon_parts"),
              **{f"trainer_peak_{key}_gib": round(value / GIB, 2) for key, value in peak.items()},
              **telemetry_figures(output, started, 2 + (args.profile + 1 if args.profile else 0)), **profile_figures(output)}
    print(json.dumps(result), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return launcher.returncode


def sample_peak_rss(launcher: subprocess.Popen) -> dict:
    """The trainer's peak resident set, every 0.2 s: "rss" (the largest of any process under the
    launcher), and the largest of each part Linux counts in it (/proc/PID/status): "anon"
    (the heap, and pinned host memory, which the CUDA driver allocates anonymously), "file"
    (mapped files: the quantized cache read through mmap) and "shmem" (files on a RAM disk such as
    /dev/shm, where the benchmark keeps the caches). "anon_parts": where the largest process's
    anonymous pages were at its anonymous peak (anon_parts), read again each time it grew 128 MiB."""
    peak = dict.fromkeys(("rss", "anon", "file", "shmem"), 0)
    parts, parts_at = {}, 0
    while launcher.poll() is None:
        for pid in descendants(launcher.pid):
            found = rss_parts(pid)  # {} for a process that exited since the walk
            for key, value in found.items():
                peak[key] = max(peak[key], value)
            if found.get("anon", 0) > parts_at + 128 * 2**20:
                parts, parts_at = anon_parts(pid) or parts, found["anon"]
        time.sleep(0.2)
    return {**peak, "anon_parts": parts}


def anon_parts(pid: int) -> dict:
    """A process's anonymous pages in GiB by where they sit (/proc/PID/smaps): the brk heap, each
    mapped file or device that holds some (library data, driver mappings), and the unnamed
    mappings by size: >= 64 MiB (large tensors, pinned buffers), 1-64 MiB (malloc's arenas and
    mmapped chunks), < 1 MiB."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return {}
    parts, name = {}, None
    for line in text.splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):
            name = fields[5] if len(fields) > 5 else ""
        elif fields[:1] == ["Anonymous:"] and int(fields[1]):
            kib = int(fields[1])
            if name.startswith("/") or name.startswith("["):
                where = name if name.startswith("[") else Path(name).name
            else:
                where = ("unnamed >= 64 MiB" if kib >= 64 * 1024 else "unnamed 1-64 MiB" if kib >= 1024
                         else "unnamed < 1 MiB")
            parts[where] = parts.get(where, 0) + kib
    top = sorted(parts.items(), key=lambda item: -item[1])
    shown = {where: round(kib / 2**20, 3) for where, kib in top[:12]}
    rest = sum(kib for _, kib in top[12:])
    return {**shown, **({"everything else": round(rest / 2**20, 3)} if rest else {})}


def rss_parts(pid: int) -> dict:
    """VmRSS and its parts RssAnon, RssFile and RssShmem of a process in bytes (Linux), {} where /proc
    has none."""
    names = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "RssShmem:": "shmem"}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {names[line.split()[0]]: int(line.split()[1]) * 1024 for line in lines if line.split()[:1] and line.split()[0] in names}


def telemetry_figures(output: Path, started: float, skip: int = 2) -> dict:
    """Seconds to the first training row, mean s/it after the first `skip` steps (warm-up, and
    the profiled ones and the one that writes their trace), peak VRAM, the allocator's retries in
    all and within those timed steps (a retry synchronises the device and empties its cache)."""
    rows = []
    for path in output.glob("*/trainer-telemetry.jsonl"):
        rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    start = next((row["time"] for row in rows if row.get("event") == "start"), None)
    speeds = [row["s_per_it"] for row in rows if row.get("s_per_it") and (row.get("step") or 0) > skip]
    peaks = [row["vram_max_allocated_gib"] for row in rows if row.get("vram_max_allocated_gib")]
    retries = [(row.get("step") or 0, row["vram_alloc_retries"]) for row in rows  # a row while loading: no step
               if row.get("vram_alloc_retries") is not None]
    timed_retries = [count for step, count in retries if step > skip]
    earlier_retries = [count for step, count in retries if step <= skip]
    pinned = [row["host_pinned_gib"] for row in rows if row.get("host_pinned_gib") is not None]
    return {"to_first_step_s": round(start - started, 1) if start else None,
            "s_per_it": round(sum(speeds) / len(speeds), 3) if speeds else None,
            "s_per_it_median": round(sorted(speeds)[len(speeds) // 2], 3) if speeds else None,
            "vram_peak_allocated_gib": max(peaks) if peaks else None,
            "vram_alloc_retries": max(count for _, count in retries) if retries else None,
            "vram_alloc_retries_timed": max(timed_retries) - max(earlier_retries, default=0) if timed_retries else None,
            "host_pinned_peak_gib": max(pinned) if pinned else None,
            "telemetry_rows": len(rows)}


def profile_figures(output: Path) -> dict:
    """The step breakdown of a profiled launch (`run --profile N`: <run>/profile/breakdown.json)."""
    found = sorted(output.glob("*/profile/breakdown.json"))
    return {"breakdown": json.loads(found[-1].read_text(encoding="utf-8"))} if found else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("pack")
    p.add_argument("--workdir", type=Path, required=True, help="a workdir made by `launcher setup`")
    p.add_argument("--image-freeze", type=Path, required=True, help="pip freeze of the GPU machine's Python")
    p.add_argument("--out", type=Path, default=Path(".bench-carry"))
    p.add_argument("--trainer-only", action="store_true", help="repack only the checkout")
    p.add_argument("--stub", nargs="+", metavar="MODULE", help="pack these imported-but-unused packages as stubs "
                   "(av: only video datasets use it; keeps the carry under a size limit)")
    p.set_defaults(handler=pack)
    p = verbs.add_parser("prepare")
    p.add_argument("--carry", type=Path, default=Path(".bench-carry"))
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--image-size", type=int, default=512, help="pixels per side (1024 for 1024 px runs)")
    p.add_argument("--model", choices=("flux2", *KLEIN_ARCH), default="flux2",
                   help="FLUX.2 [dev] with its Mistral encoder, or FLUX.2 klein 4B / 9B with its Qwen3 encoder")
    p.add_argument("--single-blocks", type=int,
                   help="single-stream blocks of the transformer (default: the model's own, 48 for the full 32B; "
                   "fewer fits a 64 GiB disk)")
    p.add_argument("--te-mlp", type=int,
                   help="the text encoder's MLP width (default: the real one, 32768 for Mistral, 44 GiB; narrower "
                   "for a small disk)")
    p.add_argument("--flux2-shape", nargs="+", type=shape_item, default=[], metavar="KEY=VALUE",
                   help="override transformer params (a toy build: hidden_size=128 num_heads=2 ...)")
    p.add_argument("--te-shape", nargs="+", type=shape_item, default=[], metavar="KEY=VALUE",
                   help="override the text encoder's config (a toy build: hidden_size=64 num_hidden_layers=27 ...)")
    p.add_argument("--model-dir", type=Path, help="where the transformer and VAE files go (default: ROOT/assets)")
    p.set_defaults(handler=prepare)
    p = verbs.add_parser("launch")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--preset", type=Path, required=True)
    p.add_argument("--label", required=True, help="names the run folder and the cut-down preset")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--model-dir", type=Path, help="the folder prepare --model-dir wrote (default: ROOT/assets)")
    p.add_argument("--cap-gib", "--vram-cap", type=float, default=24.0, metavar="GIB", help="VRAM cap (0: none)")
    p.add_argument("--set", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="override a process key, e.g. --set model.qtype int4_fused")
    p.add_argument("--launcher-set", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="a key of the preset's launcher: block, e.g. sampling force")
    p.add_argument("--profile", type=int, metavar="N", help="profile N steps (`run --profile N`); the result "
                   "carries the run's breakdown.json")
    p.add_argument("--json-out", type=Path)
    p.set_defaults(handler=launch)
    args = parser.parse_args(argv)
    if args.verb == "prepare":
        args.flux2_shape, args.te_shape = dict(args.flux2_shape), dict(args.te_shape)
    return args.handler(args)


def shape_item(text: str) -> tuple:
    """KEY=VALUE with a YAML value (64, [8, 8, 8, 8])."""
    import yaml

    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: give KEY=VALUE, e.g. hidden_size=64")
    return key, yaml.safe_load(value)


if __name__ == "__main__":
    sys.exit(main())
