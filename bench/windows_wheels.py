#!/usr/bin/env python3
"""Does every trainer requirement have a Windows wheel? One `pip download` per line, for win_amd64 / 3.12.

Native Windows has no compiler in a plain venv, so a requirement without a win_amd64 (or pure-Python)
wheel either needs a build toolchain or fails at setup. Each line of the trainer's requirements.txt is
downloaded alone (--no-deps, binaries only) into a temporary folder that is deleted afterwards; git-pinned
lines are recorded as such (pip builds them from source). The result is results/windows_wheels.csv.

    python bench/windows_wheels.py --requirements .aitk/trainer/requirements.txt
"""

import argparse
import csv
import datetime
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIP = ["--no-deps", "--only-binary=:all:", "--platform", "win_amd64", "--python-version", "3.12"]

# what the fork loses without each package: where it imports it (ai-toolkit fork at the locked commit)
LOSSES = {
    "torchao": "toolkit/util/quantize.py: the uint4/int8 weight quantization (the 4-bit path)",
    "safetensors": "every model and LoRA load/save",
    "easy_dwpose": "toolkit/control_generator.py: DWPose control images only",
    "diffusers": "the pipelines, VAE and schedulers: the trainer does not start",
    "transformers": "the text encoders: the trainer does not start",
    "lycoris-lora": "toolkit/lycoris_special.py: LoKr/LyCORIS networks only",
    "flatten_json": "nothing imported by the fork",
    "pyyaml": "config files: the trainer does not start",
    "oyaml": "toolkit/config.py: ordered YAML configs: the trainer does not start",
    "tensorboard": "nothing imported directly (torch.utils.tensorboard logging only)",
    "kornia": "nothing imported by the fork",
    "invisible-watermark": "nothing imported by the fork",
    "einops": "model code of most architectures, FLUX.2 included",
    "accelerate": "toolkit/accelerator.py: device placement: the trainer does not start",
    "toml": "nothing imported by the fork",
    "albumentations": "toolkit/data_loader.py: dataset augmentations",
    "albucore": "nothing imported directly (albumentations' own dependency)",
    "pydantic": "nothing imported directly (UI and dependencies)",
    "omegaconf": "nothing imported directly",
    "k-diffusion": "toolkit/sampler.py, pipelines.py: k-diffusion samplers for previews",
    "open_clip_torch": "nothing imported directly",
    "timm": "nothing imported directly (model dependencies)",
    "prodigyopt": "toolkit/optimizer.py: the Prodigy optimizer only",
    "controlnet_aux": "toolkit/control_generator.py: control-image generators only",
    "python-dotenv": "run.py: .env loading",
    "bitsandbytes": "toolkit/optimizer.py: 8-bit optimizers (adamw8bit) only",
    "hf_transfer": "nothing imported (faster Hub downloads when enabled)",
    "lpips": "VAE training and feature-extraction losses only",
    "pytorch_fid": "testing/test_vae.py only",
    "optimum-quanto": "quantize.py and most model loaders: qfloat8/qint quantization",
    "sentencepiece": "nothing imported directly (T5/Mistral tokenizers)",
    "huggingface_hub": "model downloads: the trainer does not start",
    "peft": "the f_light model only",
    "gradio": "flux_train_ui.py, the old Gradio UI only",
    "python-slugify": "flux_train_ui.py only",
    "opencv-python": "toolkit/data_loader.py and dataset tools: image loading and bucketing",
    "pytorch-wavelets": "toolkit/util/losses.py: the wavelet loss only",
    "matplotlib": "nothing imported by the fork",
    "setuptools": "packaging only",
}


def requirement_lines(path: Path) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for line in path.read_text(encoding="utf-8").splitlines()]
    return [line for line in lines if line and not line.startswith("-")]


def name_of(spec: str) -> str:
    if spec.startswith("git+"):
        return spec.rstrip("/").split("/")[-1].split("@")[0].removesuffix(".git")
    return re.split(r"[<>=!~\[; ]", spec, maxsplit=1)[0]


def check(spec: str) -> tuple[str, str]:
    """(has_win_wheel, the wheel's file name or the reason there is none)."""
    if spec.startswith("git+"):
        return "no", "git-pinned: pip builds it from source (needs git, and a compiler if it has extensions)"
    result, files = _download(spec, PIP)
    if result.returncode == 0 and files:
        return "yes", files[0]
    _, sources = _download(spec, ["--no-deps", "--no-binary=:all:"])
    if sources:
        return "no", f"sdist only ({sources[0]}): pip builds it at install (pure Python builds need no compiler)"
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    return "no", (errors[-1] if errors else f"pip exit {result.returncode}")[:200]


def _download(spec: str, options: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """pip download into a temporary folder, deleted afterwards; the names of the files it got."""
    with tempfile.TemporaryDirectory() as folder:
        result = subprocess.run([sys.executable, "-m", "pip", "download", *options, "-d", folder, spec],
                                capture_output=True, text=True)
        return result, sorted(path.name for path in Path(folder).iterdir())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requirements", type=Path, default=Path(".aitk/trainer/requirements.txt"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "windows_wheels.csv")
    args = parser.parse_args(argv)
    today = datetime.date.today().isoformat()
    rows = []
    for spec in requirement_lines(args.requirements):
        name = name_of(spec)
        has, detail = check(spec)
        print(f"{has:3} {spec}: {detail}", flush=True)
        rows.append([name, spec, has, detail, LOSSES.get(name, "not looked up"), today, ""])
    with args.out.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle, lineterminator="\n")
        writer.writerow(["package", "spec", "has_win_wheel", "wheel or error", "the trainer loses without it", "date", "source"])
        writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
