#!/usr/bin/env python3
"""Full-size runs through `python -m launcher run` on a GPU machine that has no network.

Three steps, each a subcommand:

  pack     (here, with network) the trainer's packages that the GPU machine's Python lacks or has
           at another version, installed for CPython 3.12 into one tree and packed, plus the
           patched checkout's files:  .bench-carry/site.tar.xz, .bench-carry/trainer.tar.xz
  prepare  (there) a workdir R/wd whose venv is made from that machine's Python and sees its
           site-packages after the packed tree (a .pth file), a VRAM cap applied inside the trainer
           process by another .pth file (BENCH_VRAM_CAP_GIB, from `launch --vram-cap`; checked by
           an allocation above it that must fail), and random-weight assets in R/assets: the full
           32B FLUX.2 transformer (about 60 GiB), the real VAE shape, a Mistral3 text encoder of
           the real width and depth but a narrow MLP, and a captioned dataset
  launch   (there) one `launcher run` of a preset with the steps cut short, while the trainer's
           host memory is sampled every 0.2 s; one JSON object of figures

    python bench/fullsize.py pack --workdir W --image-freeze FREEZE.txt
    python3 bench/fullsize.py prepare --carry .bench-carry --root R
    python3 bench/fullsize.py launch --root R --preset presets/rtx4090_512.yaml --label first --steps 6

FREEZE.txt is `python -m pip list --format=freeze` run with the GPU machine's Python. Random
weights give meaningless images and losses; memory, load times and step times are real.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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
# Real Mistral-Small-3.1-24B text shape; only the MLP is narrowed to keep the folder small.
TEXT_SHAPE = {"hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 32,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 512,
              "vocab_size": 131072, "max_position_embeddings": 131072, "rope_theta": 1e9}
REAL_AE = {"resolution": 256, "in_channels": 3, "ch": 128, "out_ch": 3, "ch_mult": [1, 2, 4, 4],
           "num_res_blocks": 2, "z_channels": 32}
GIB = 2**30
VRAM_CAP_MODULE = '''"""BENCH_VRAM_CAP_GIB caps the CUDA allocator of the trainer process (`python run.py ...`) at startup
(set_per_process_memory_fraction), then proves it: an allocation 256 MiB above the cap must fail."""
import os
import sys

PROBE = 2 ** 28


def apply():
    cap_gib = float(os.environ.get("BENCH_VRAM_CAP_GIB") or 0)
    if cap_gib <= 0 or not sys.argv or not sys.argv[0].endswith("run.py"):
        return
    import torch

    cap = int(cap_gib * 2 ** 30)
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    try:
        probe = torch.empty(cap + PROBE, dtype=torch.uint8, device="cuda")
    except torch.cuda.OutOfMemoryError:
        print(f"[vram cap] {cap_gib:g} GiB applied in the trainer process: an allocation of "
              f"{(cap + PROBE) / 2 ** 30:.2f} GiB failed", flush=True)
        torch.cuda.empty_cache()
        return
    del probe
    print(f"[vram cap] NOT APPLIED: {(cap + PROBE) / 2 ** 30:.2f} GiB were allocated under a {cap_gib:g} GiB cap",
          flush=True)
    sys.exit(3)


apply()
'''
CAP_APPLIED = "[vram cap] "


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
        pack_site(workdir, args.image_freeze, args.out)
    pack_trainer(workdir, args.out)
    for name in ("site.tar.xz", "trainer.tar.xz"):
        print(f"{args.out / name}: {(args.out / name).stat().st_size / 2**20:.1f} MiB", flush=True)
    return 0


def pack_site(workdir, image_freeze: Path, out: Path) -> None:
    """The packages a run imports that the GPU machine lacks, installed for cp312, as one archive."""
    from launcher.envs.workdir import venv_python

    python = venv_python(workdir.venv)
    wanted = packages_to_carry(freeze(python), parse_freeze(image_freeze.read_text(encoding="utf-8")),
                               imported_distributions(python, workdir.trainer))
    site_dir = next(workdir.venv.glob("lib/python3*/site-packages"))
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
    timed("assets", lambda: build_assets(root / "wd" / "trainer", root / "assets", args.images, args.single_blocks,
                                         args.image_size))
    return 0


def make_venv(root: Path) -> None:
    """A venv of this Python that sees the packed tree first, then this Python's own packages."""
    import site

    venv = root / "wd" / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = next(venv.glob("lib/python3*/site-packages"))
    (packages / "carry.pth").write_text("\n".join([str(root / "site"), *site.getsitepackages()]) + "\n")
    # the VRAM cap, inside the trainer process: a venv sitecustomize.py is shadowed by the image's
    # own and silently does nothing; a .pth line that starts with `import` runs at every start
    (packages / "bench_vram_cap.py").write_text(VRAM_CAP_MODULE)
    (packages / "bench_vram_cap.pth").write_text("import bench_vram_cap\n")


def build_assets(trainer: Path, out: Path, images: int, single_blocks: int, image_size: int = 512) -> None:
    from launcher.in_trainer import tiny_assets

    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(trainer))
    from extensions_built_in.diffusion_models.flux2.src.autoencoder import AutoEncoder, AutoEncoderParams
    from extensions_built_in.diffusion_models.flux2.src.model import Flux2, Flux2Params

    shape = Flux2Params(depth_single_blocks=single_blocks)
    timed("transformer", lambda: write_random_checkpoint(Flux2, shape, out / "flux2-dev.safetensors"))
    timed("vae", lambda: write_random_checkpoint(AutoEncoder, AutoEncoderParams(**REAL_AE), out / "ae.safetensors"))
    timed("text encoder", lambda: tiny_assets.build_text_encoder(out, seed=0, **TEXT_SHAPE))
    tiny_assets.build_dataset(out, seed=0, size=image_size, count=images)


def write_random_checkpoint(module_class, params, path: Path) -> None:
    """A single-file bf16 checkpoint of `module_class`, written tensor by tensor (GPU if there is one).

    Matrices are N(0, 0.02), norm scales ones, other vectors zeros: finite activations, so the
    loss is a number, which is all a benchmark needs.
    """
    import torch

    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in module_class(params).state_dict().items()}
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


def timed(label: str, work) -> None:
    started = time.monotonic()
    work()
    print(f"{label}: {time.monotonic() - started:.1f} s", flush=True)


def launch(args) -> int:
    import psutil
    import yaml

    root = args.root.resolve()
    preset = yaml.safe_load(args.preset.read_text(encoding="utf-8"))
    process = preset["config"]["process"][0]
    process["train"]["steps"] = args.steps
    process["save"]["save_every"] = args.steps + 1000
    for key, value in (args.set or []):
        target = process
        *path, last = key.split(".")
        for part in path:  # a number indexes a list: datasets.0.resolution
            target = target[int(part)] if part.isdigit() else target.setdefault(part, {})
        target[last] = yaml.safe_load(value)
    short = root / "presets" / f"{args.label}.yaml"
    short.parent.mkdir(parents=True, exist_ok=True)
    short.write_text(yaml.safe_dump(preset, sort_keys=False), encoding="utf-8")
    assets, output = root / "assets", root / "runs" / args.label
    command = [sys.executable, "-m", "launcher", "run", str(short), "--workdir", str(root / "wd"),
               "--model-dir", str(assets), "--text-encoder", str(assets / "text_encoder"),
               "--dataset", str(assets / "dataset"), "--output", str(output)]
    env = {**os.environ, "PYTHONPATH": str(root / "site"), "BENCH_VRAM_CAP_GIB": str(args.vram_cap) if args.vram_cap else ""}
    started = time.time()
    launcher = subprocess.Popen(command, cwd=REPO, env=env)
    peak_rss = sample_peak_rss(psutil.Process(launcher.pid), launcher)
    wall = time.time() - started
    result = {"label": args.label, "preset": str(args.preset), "rc": launcher.returncode, "wall_s": round(wall, 1),
              "cap_gib": args.vram_cap, "cap_checked": cap_line(output), "trainer_peak_rss_gib": round(peak_rss / GIB, 2),
              **telemetry_figures(output, started)}
    print(json.dumps(result), flush=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return launcher.returncode


def cap_line(output: Path) -> str | None:
    """The trainer's own word that the VRAM cap holds (an allocation above it failed), or None."""
    for log in output.glob("*/train.log"):
        for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith(CAP_APPLIED):
                return line[len(CAP_APPLIED):]
    return None


def sample_peak_rss(launcher, child: subprocess.Popen) -> int:
    """The largest resident set of any process under the launcher (the trainer), every 0.2 s."""
    peak = 0
    while child.poll() is None:
        try:
            peak = max([peak, *(p.memory_info().rss for p in launcher.children(recursive=True))])
        except Exception:  # a child exited between listing and reading
            pass
        time.sleep(0.2)
    return peak


def telemetry_figures(output: Path, started: float) -> dict:
    """Seconds to the first training row, mean s/it after the first two steps, peak VRAM."""
    rows = []
    for path in output.glob("*/trainer-telemetry.jsonl"):
        rows += [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    start = next((row["time"] for row in rows if row.get("event") == "start"), None)
    speeds = [row["s_per_it"] for row in rows if row.get("s_per_it") and row.get("step", 0) > 2]
    peaks = [row["vram_max_allocated_gib"] for row in rows if row.get("vram_max_allocated_gib")]
    return {"to_first_step_s": round(start - started, 1) if start else None,
            "s_per_it": round(sum(speeds) / len(speeds), 3) if speeds else None,
            "vram_peak_allocated_gib": max(peaks) if peaks else None,
            "telemetry_rows": len(rows)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    verbs = parser.add_subparsers(dest="verb", required=True)
    p = verbs.add_parser("pack")
    p.add_argument("--workdir", type=Path, required=True, help="a workdir made by `launcher setup`")
    p.add_argument("--image-freeze", type=Path, required=True, help="pip freeze of the GPU machine's Python")
    p.add_argument("--out", type=Path, default=Path(".bench-carry"))
    p.add_argument("--trainer-only", action="store_true", help="repack only the checkout")
    p.set_defaults(handler=pack)
    p = verbs.add_parser("prepare")
    p.add_argument("--carry", type=Path, default=Path(".bench-carry"))
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--images", type=int, default=8)
    p.add_argument("--image-size", type=int, default=512, help="pixels per side (1024 for 1024 px runs)")
    p.add_argument("--single-blocks", type=int, default=48,
                   help="single-stream blocks of the transformer (48: the full 32B; fewer fits a 64 GiB disk)")
    p.set_defaults(handler=prepare)
    p = verbs.add_parser("launch")
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--preset", type=Path, required=True)
    p.add_argument("--label", required=True, help="names the run folder and the cut-down preset")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--vram-cap", "--cap-gib", type=float, default=24.0, metavar="GIB",
                   help="cap the trainer process's CUDA allocator at GIB, checked by an allocation that must fail "
                        "(0: none)")
    p.add_argument("--set", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="override a process key, e.g. --set model.qtype int4_fused")
    p.add_argument("--json-out", type=Path)
    p.set_defaults(handler=launch)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
