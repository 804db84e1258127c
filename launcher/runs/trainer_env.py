"""What a preset's `launcher.env` may hand the trainer process: an allow list, each entry with its reason.

Any other variable could redirect what the trainer writes or caches, what it imports, or the run
folder's own files; those `run` sets itself are refused with what to write instead. The variables
a library reads for a setting the self-test decides (FROM_SETTINGS) are set from the run's resolved
config only, so each has one route: the setting.
"""

from dataclasses import dataclass

from launcher.runs.schema_nodes import Block, Spec, problem, short
from launcher.suggest import did_you_mean


@dataclass(frozen=True)
class SetByLauncher(Spec):
    """An environment variable naming a file `run` writes into the run folder: a preset's value
    would send the trainer's output elsewhere, past the run folder's link checks."""

    instead: str

    def check(self, value, path, vocab):
        yield f"{path} = {short(value)}: set by the launcher to a file in the run folder; {self.instead}"


@dataclass(frozen=True)
class NowASetting(Spec):
    """A variable the trainer once read, now a model_kwargs setting of the config (docs/options.md)."""

    setting: str

    def check(self, value, path, vocab):
        yield (f"{path} = {short(value)}: the trainer reads no AITK_ variable; remove it and set model_kwargs "
               f"{self.setting} in the preset")


EXPANDABLE = "expandable_segments:True"
ALLOCATOR_VARIABLES = ("PYTORCH_HIP_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""What `run` sets to EXPANDABLE (wall 7); doctor says so for these and only these."""
ENV_ALLOWED = {
    # variable: why a preset may set it (none moves a file the trainer writes or reads, or the code it runs)
    "HF_HUB_OFFLINE": "keeps the Hugging Face libraries off the network (the tiny preset)",
    "HF_HUB_DISABLE_TELEMETRY": "only stops the Hugging Face libraries' usage reports",
    "TRANSFORMERS_OFFLINE": "keeps transformers off the network",
    "HF_DATASETS_OFFLINE": "keeps datasets off the network",
    "TOKENIZERS_PARALLELISM": "the tokenizers' thread pool, and its fork warning",
    "TRITON_CACHE_AUTOTUNING": "keeps Triton's autotuning results in its cache (set by `run`)",
    "TRITON_INTERPRET": "runs Triton kernels in its interpreter (debugging)",
    "CUDA_VISIBLE_DEVICES": "which NVIDIA GPU trains",
    "HIP_VISIBLE_DEVICES": "which AMD GPU trains",
    "ROCR_VISIBLE_DEVICES": "which AMD GPU trains",
    "HSA_OVERRIDE_GFX_VERSION": "the GPU target ROCm treats a consumer AMD card as",
    "CUDA_LAUNCH_BLOCKING": "synchronous kernel launches (debugging)",
    "AMD_SERIALIZE_KERNEL": "serialized kernel launches on ROCm (debugging)",
    "TORCH_BLAS_PREFER_HIPBLASLT": "the BLAS library PyTorch uses on ROCm",
    "PYTORCH_CUDA_ALLOC_CONF": "the CUDA allocator's settings (`launcher.allocator` sets it)",
    "PYTORCH_HIP_ALLOC_CONF": "the ROCm allocator's settings (`launcher.allocator` sets it)",
    "OMP_NUM_THREADS": "CPU threads of the host-side work",
    "MKL_NUM_THREADS": "CPU threads of the host-side work",
}
FROM_SETTINGS = {
    # variable: (the model_kwargs setting, its value that sets the variable, the variable's value)
    "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL": ("sdpa_kernels", "experimental", "1"),
    "MIOPEN_FIND_MODE": ("miopen_find_mode", "fast", "FAST"),
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": ("lora_matmuls", "tf32", "1"),
}
"""Variables PyTorch's and MIOpen's libraries read, each set by `run` from one model_kwargs setting
(the self-test's verdict, or the preset's value): PyTorch reads the first once, at the first
attention, MIOpen the second at its first search, and PyTorch the third when it starts (its float32
matmul precision then begins at "high", TF32), so the process starts with them."""
ENV_ALLOWED_PREFIXES = {
    "AITK_TEST_": "read only by the tests' own interpreter wrappers (tests/test_atomic_save.py); the trainer ignores them",
}
"""The variables a preset's `launcher.env` may set. Any other could redirect what the trainer writes
or caches (AITK_QUANT_CACHE_DIR, AITK_TEXT_CACHE_DIR, TRITON_CACHE_DIR, TORCHINDUCTOR_CACHE_DIR,
HF_HOME, TMPDIR: set those in the environment `run` starts from, where the launcher sees them too),
what it imports (PYTHONPATH) or the run folder's own files (`run` writes those into the config)."""


@dataclass(frozen=True)
class SetFromSetting(Spec):
    """A library's variable `run` sets from a model_kwargs setting (FROM_SETTINGS)."""

    def check(self, value, path, vocab):
        setting, chosen, _ = FROM_SETTINGS[path.rsplit(".", 1)[-1]]
        yield (f"{path} = {short(value)}: `run` sets it from model_kwargs {setting} (the self-test's verdict); "
               f"remove it and set model_kwargs {setting}: {chosen} in the preset")


def from_settings(config: dict) -> dict[str, str]:
    """The FROM_SETTINGS variables a resolved config's model_kwargs call for."""
    found = {}
    for process in config["config"]["process"]:
        kwargs = (process.get("model") or {}).get("model_kwargs") or {}
        found.update({name: value for name, (setting, chosen, value) in FROM_SETTINGS.items()
                      if kwargs.get(setting) == chosen})
    return found


@dataclass(frozen=True)
class EnvName(Spec):
    """A `launcher.env` variable the allow list does not name."""

    def check(self, value, path, vocab):
        name = path.rsplit(".", 1)[-1]
        if name.startswith(tuple(ENV_ALLOWED_PREFIXES)):
            yield from EnvValue().check(value, path, vocab)
            return
        yield (f"{path} = {short(value)}: not a variable a preset may set (it could redirect the trainer's writes, "
               f"caches or imports; a cache folder is set in the environment `run` starts from){did_you_mean(name, ENV_ALLOWED)}; "
               f"allowed: {', '.join(sorted(ENV_ALLOWED))}, {', '.join(p + '...' for p in ENV_ALLOWED_PREFIXES)}")


@dataclass(frozen=True)
class EnvValue(Spec):
    """One allowed `launcher.env` variable's value: a single line of text a process environment can hold."""

    allowed = "text, a number or true/false, without a NUL character"

    def check(self, value, path, vocab):
        if not isinstance(value, (str, int, float, bool)):
            yield problem(path, value, "not a single value", self.allowed)
        elif "\0" in str(value):
            yield problem(path, value, "holds a NUL character, which no environment variable can", self.allowed)


def env_block() -> Block:
    """`launcher.env`: the allow list's variables, each a single value; the launcher's own refused."""
    return Block({
        "AITK_TELEMETRY": SetByLauncher("remove it (the rows go to <run>/trainer-telemetry.jsonl)"),
        "AITK_TELEMETRY_INTERVAL": SetByLauncher("remove it and set launcher.telemetry.interval_s"),
        "AITK_PROFILE_DIR": SetByLauncher("remove it (`run --profile N` writes to <run>/profile)"),
        "AITK_PROFILE_STEPS": SetByLauncher("remove it and use `run --profile N`"),
        "AITK_PROFILE_SKIP": NowASetting("profile_skip"),
        "AITK_ALL_EXTENSIONS": NowASetting("all_extensions: true"),
        **dict.fromkeys(FROM_SETTINGS, SetFromSetting()),
        **dict.fromkeys(ENV_ALLOWED, EnvValue()),
    }, extra=EnvName())
