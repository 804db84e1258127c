"""The text phase: every prompt of a training run embedded before the transformer loads.

A run that caches text embeddings needs the text encoder only for a known set of texts: the
captions, the empty caption of caption dropout, the unconditional prompt, the trigger word,
the sample prompts. run_prompts() lists them from the trainer's own caption code; the phase
then takes each from the embedding cache or computes the missing ones with the streamed
encoder (toolkit/streamed_text_encoder.py), and the model answers encode_prompt() from
TextEmbeddings instead of a loaded encoder. The 24B encoder (or FLUX.2 klein's Qwen3) is never
whole in memory, and a relaunch whose prompts are all cached does not open it at all.

Switch: model_kwargs streamed_text_encoder (default true). A run that encodes captions at
every step (no cache_text_embeddings, no unload_text_encoder) keeps the whole encoder.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from flux2_contract.settings import CATALOGUE, read
from toolkit.streamed_text_encoder import (
    EncoderFolder, PromptTemplate, StreamedTextEncoder, TextEncoderFolderError, encode_in_groups,
    group_size_for, open_encoder,
)
from toolkit.text_embedding_cache import (
    TextEmbeddingCache, cache_folder, key_digest, recall_encoder, remember_encoder,
)

DEFAULT_BUDGET_MIB = CATALOGUE["text_phase_budget_mib"].default  # hidden states one encoder pass may hold


@dataclass
class RunPrompts:
    """What a training process will ask the text encoder for; prompts is None when it cannot
    say (captions encoded at every step), with the reason."""

    prompts: Optional[List[str]]
    reason: str = ""


def run_prompts(process) -> RunPrompts:
    """Every text the process encodes, read before the model loads."""
    train = process.train_config
    if train.train_text_encoder:
        return RunPrompts(None, "the text encoder is trained")
    caching = process.is_caching_text_embeddings
    if not (caching or train.unload_text_encoder):
        return RunPrompts(None, "captions are encoded at every step (set train.cache_text_embeddings: true)")
    if getattr(process.sd, "encode_control_in_text_embeddings", False):
        return RunPrompts(None, "this model encodes control images with the text")
    prompts = ["", train.unconditional_prompt, process.trigger_word]
    if train.diff_output_preservation:
        prompts.append(train.diff_output_preservation_class)
    if caching:
        prompts += dataset_captions(process.dataset_configs, process.sd)
    if not train.disable_sampling:
        prompts += sample_prompts(process.sample_config)
    return RunPrompts(list(dict.fromkeys(p for p in prompts if p is not None)))


def dataset_files(config) -> List[tuple]:
    """(image path, caption dict or None, dataset root) as the dataset enumerates them."""
    from toolkit.data_loader import image_extensions, video_extensions

    source = config.dataset_path or config.folder_path
    if os.path.isdir(source):
        suffixes = tuple(video_extensions if config.num_frames > 1 else image_extensions)
        files = [os.path.join(root, name) for root, _, names in os.walk(source)
                 for name in names if name.lower().endswith(suffixes)]
        captions, root = None, source
    else:
        with open(source, "r", encoding="utf-8") as f:
            captions = json.load(f)
        files, root = list(captions), os.path.dirname(source)
    return [(path, captions, root) for path in files if os.path.basename(os.path.dirname(path)) != "_controls"]


def dataset_captions(dataset_configs, sd) -> List[str]:
    """The captions the dataset's text-embedding cache will ask for, from its own FileItemDTO.

    Caption code may draw from `random` (shuffled tokens, random triggers); the state is
    restored so training sees the same draws as without this pass.
    """
    from toolkit.data_transfer_object.data_loader import FileItemDTO

    state = random.getstate()
    try:
        captions = []
        for config in dataset_configs:
            if not config.cache_text_embeddings:
                continue
            for path, caption_dict, root in dataset_files(config):
                item = FileItemDTO(sd=sd, path=path, dataset_config=config, dataloader_transforms=None,
                                   size_database={}, dataset_root=root, encode_control_in_text_embeddings=False)
                item.load_caption(caption_dict)
                captions += item_texts(item, config)
        return captions
    finally:
        random.setstate(state)


def item_texts(item, config) -> List[str]:
    """What the dataset's cache encodes for one file: its caption and, where the trainer caches
    them too (upstream ai-toolkit), the caption-dropout and output-preservation variants."""
    texts = [item.get_text_embedding_info_dict()["caption"]]
    preserving = getattr(config, "diff_output_preservation", False)
    if preserving and getattr(item, "caption_dop", None) is not None:
        texts.append(item.caption_dop)
    if config.caption_dropout_rate > 0 and hasattr(item, "get_dropout_caption"):
        texts.append(item.get_dropout_caption())
        if preserving and hasattr(item, "get_dop_dropout_caption"):
            texts.append(item.get_dop_dropout_caption())
    return texts


def sample_prompts(sample_config) -> List[str]:
    from toolkit.config_modules import GenerateImageConfig

    prompts = []
    for prompt, sample in zip(sample_config.prompts, sample_config.samples):
        parsed = GenerateImageConfig(prompt=prompt, negative_prompt=sample.neg, output_path="unused.jpg")
        # a sample without a negative prompt parses it as False, not text
        prompts += [text for text in (parsed.prompt, parsed.negative_prompt) if isinstance(text, str)]
    return prompts


@dataclass
class TextEmbeddings:
    """Prompt -> embedding, from the cache (or memory); late prompts are encoded on demand."""

    cache: Optional[TextEmbeddingCache]
    phase: "TextPhase"
    identity: str  # encoder, template and dtype, hashed
    memory: Dict[str, torch.Tensor] = field(default_factory=dict)

    def get(self, prompts) -> torch.Tensor:
        """[len(prompts), max_length, width] on the CPU."""
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        found = {p: self._lookup(p) for p in dict.fromkeys(prompts)}
        late = [p for p, embeds in found.items() if embeds is None]
        if late:
            self.phase.log(f"text phase: {len(late)} prompt(s) were not known before loading; encoding them now")
            found.update(self.phase.encode(late, self))
        return torch.stack([found[p] for p in prompts])

    def _lookup(self, prompt: str) -> Optional[torch.Tensor]:
        if prompt in self.memory:
            return self.memory[prompt]
        return self.cache.load(prompt) if self.cache is not None else None

    def keep(self, prompt: str, embeds: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.save(prompt, embeds)
        else:
            self.memory[prompt] = embeds


@dataclass
class TextPhase:
    """One encoder folder and template; opens the encoder only when a prompt is missing."""

    encoder_path: Path
    template: PromptTemplate
    context_width: int  # the transformer's txt_in width: len(hidden_layers) x hidden size
    device: torch.device
    dtype: torch.dtype = torch.bfloat16
    budget_bytes: int = DEFAULT_BUDGET_MIB * 2**20
    log: Callable[[str], None] = print
    encoder: Optional[EncoderFolder] = None

    def identify(self, cache_dir: Optional[Path]) -> str:
        """The encoder's identity; validates the folder, or recalls it when the folder is gone."""
        if self.encoder_path.is_dir():
            self.encoder = open_encoder(self.encoder_path, max(self.template.hidden_layers))
            facts = {"identity": self.encoder.identity(), "hidden_size": self.encoder.hidden_size}
            self._check_width(facts["hidden_size"], str(self.encoder_path / "config.json"))
            if cache_dir is not None:
                remember_encoder(cache_dir, self.encoder_path, facts)
            return facts["identity"]
        facts = recall_encoder(cache_dir, self.encoder_path) if cache_dir is not None else None
        if facts is None:
            raise TextEncoderFolderError(
                f"text encoder folder {self.encoder_path} not found, and no embedding cache was made "
                "from it; set model_kwargs text_encoder_path to the text encoder's model folder")
        self._check_width(facts["hidden_size"], f"the embedding cache's record of {self.encoder_path}")
        return facts["identity"]

    def _check_width(self, hidden_size: int, source: str) -> None:
        layers = len(self.template.hidden_layers)
        if hidden_size * layers != self.context_width:
            raise TextEncoderFolderError(
                f"{source}: hidden size {hidden_size} x {layers} stacked hidden states = "
                f"{hidden_size * layers}, but the transformer's context width (context_in_dim) is "
                f"{self.context_width}; use the text encoder this FLUX.2 model was made for")

    def encode(self, prompts: List[str], store: TextEmbeddings) -> Dict[str, torch.Tensor]:
        """Stream the encoder over `prompts`; every result goes to the store as it is made."""
        if self.encoder is None:
            raise TextEncoderFolderError(
                f"text encoder folder {self.encoder_path} not found and {len(prompts)} prompt(s) are not "
                f"in the embedding cache (e.g. {prompts[0]!r}); restore the folder or fix text_encoder_path")
        streamed = StreamedTextEncoder(self.encoder, self.template, self.device, self.dtype, log=self.log)
        made = {}
        for prompt, embeds in encode_in_groups(streamed, prompts, group_size_for(self.encoder, self.template, self.budget_bytes)):
            store.keep(prompt, embeds)
            made[prompt] = embeds
        return made


def run_text_phase(phase: TextPhase, prompts: List[str], cache_dir: Optional[Path]) -> TextEmbeddings:
    """Check the encoder, then make sure every prompt has an embedding; says what it did."""
    start = time.perf_counter()
    key = {"encoder": phase.identify(cache_dir), "template": phase.template.key(), "dtype": str(phase.dtype)}
    cache = TextEmbeddingCache(cache_dir, key, log=phase.log) if cache_dir is not None else None
    store = TextEmbeddings(cache, phase, key_digest(key))
    missing = [p for p in prompts if cache is None or not cache.has(p)]
    phase.log(f"text phase: {len(prompts)} prompt(s), {len(prompts) - len(missing)} cached"
              + (f" in {cache_dir}" if cache is not None else " (no cache folder)"))
    if missing:
        phase.encode(missing, store)
    else:
        phase.log("text phase: every prompt is cached; the text encoder is not opened")
    phase.log(f"text phase: done in {time.perf_counter() - start:.1f} s")
    return store


def text_phase_for_model(model, encoder_path: str, template: PromptTemplate, context_width: int
                         ) -> Optional[TextEmbeddings]:
    """Run the text phase for a BaseModel when the run allows it; None keeps the loaded encoder."""
    config = model.model_config
    kwargs = config.model_kwargs
    plan = getattr(model, "plan_prompts", None)  # set by the training process
    if not read(kwargs, "streamed_text_encoder") or plan is None:
        return None
    log = model.print_and_status_update
    planned: RunPrompts = plan()
    if planned.prompts is None:
        log(f"text phase: not used, {planned.reason}; loading the whole text encoder")
        return None
    if config.quantize_te:
        log("text phase: quantize_te is not used; the streamed encoder gives bf16 embeddings "
            "(model_kwargs streamed_text_encoder: false loads the 4-bit encoder instead)")
    budget = read(kwargs, "text_phase_budget_mib") * 2**20
    phase = TextPhase(resolve_encoder_path(encoder_path), template, context_width, model.device_torch,
                      model.torch_dtype, budget, log)
    folder = cache_folder(kwargs, getattr(model, "training_folder", None))
    embeddings = run_text_phase(phase, planned.prompts, folder)
    # the dataset's per-caption cache files then keep other encoders' embeddings apart
    model.text_encoder_identity = embeddings.identity
    return embeddings


def resolve_encoder_path(path_or_id: str) -> Path:
    """A local folder as given; a hub id as its local snapshot (downloaded if need be)."""
    local = Path(path_or_id)
    if local.exists() or "/" not in path_or_id or os.path.isabs(path_or_id):
        return local
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "tekken.json", "merges.txt"]
    try:
        return Path(snapshot_download(path_or_id, allow_patterns=patterns, local_files_only=True))
    except LocalEntryNotFoundError:  # not cached yet: the whole-encoder path would download it too
        return Path(snapshot_download(path_or_id, allow_patterns=patterns))
