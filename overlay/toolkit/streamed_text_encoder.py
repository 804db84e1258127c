"""The FLUX.2 text encoder (Mistral3; klein's Qwen3) run one decoder layer at a time from its
safetensors shards.

FLUX.2 reads three hidden states of the 24B Mistral encoder (after layers 10, 20 and 30 of
40). Loading it whole costs ~48 GB of host RAM in bf16 (and ~12 GB of VRAM after a 4-bit
quantization that degrades the embeddings). This module computes the same bf16 hidden states
with one layer alive at a time: the embedding rows the prompts use are read from the table,
then each decoder layer is built from its tensors, moved to the compute device, run for every
prompt of a group, and dropped; it stops after the deepest hidden state asked for. Host RAM
stays near one layer plus the group's hidden states; VRAM near one layer plus activations.

The layer, mask and rotary code are transformers' own (MistralDecoderLayer, its causal-mask
builders, MistralRotaryEmbedding), called the way MistralModel.forward calls them, so the
numbers are those of `Mistral3ForConditionalGeneration(..., output_hidden_states=True)`. FLUX.2
klein's Qwen3 encoder (hidden states 9, 18 and 27) goes the same way with transformers' Qwen3
classes (FAMILIES), tokenized as klein's pipeline does: chat template as text, then the tokenizer.

open_encoder() validates the folder (config, index, every shard's header, every needed
tensor) before any long work, so a missing or truncated shard is named up front.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from toolkit.streamed_safetensors import SafetensorsHeaderError, StreamedSafetensors

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Where Mistral3 checkpoints keep the language model: the hub layout, then the layout
# transformers >= 4.52 writes, then a plain MistralForCausalLM.
LANGUAGE_MODEL_PREFIXES = ("model.language_model.model.", "language_model.model.", "model.language_model.", "model.")
# Files that decide how a prompt becomes token ids; part of the encoder's identity.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "tekken.json", "chat_template.jinja", "chat_template.json", "processor_config.json",
    "preprocessor_config.json", "vocab.json", "merges.txt",
)
LAYER_TENSORS = (
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
)


@dataclass(frozen=True)
class EncoderFamily:
    """A language model the text phase can stream: transformers' classes for it, and its files."""

    model_type: str  # the text config's model_type
    module: str  # transformers.models.<module>.modeling_<module>
    classes: str  # the class-name prefix there (<classes>DecoderLayer, RotaryEmbedding, RMSNorm)
    layer_tensors: Tuple[str, ...]
    tokenizer: Optional[str]  # a transformers tokenizer class; None: the folder's processor
    rotary_in_compute_dtype: bool  # the whole-encoder load casts the rotary buffer too

    def modeling(self, name: str):
        import importlib

        module = importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")
        return getattr(module, self.classes + name)


FAMILIES = {
    "mistral": EncoderFamily("mistral", "mistral", "Mistral", LAYER_TENSORS, None, True),
    # klein loads Qwen3ForCausalLM with its dtype and never casts it again (flux2_klein_model.py)
    "qwen3": EncoderFamily("qwen3", "qwen3", "Qwen3", LAYER_TENSORS + ("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
                           "Qwen2Tokenizer", False),
}


class TextEncoderFolderError(ValueError):
    """The text encoder folder cannot serve the text phase; the message says what to fix."""


@dataclass(frozen=True)
class PromptTemplate:
    """How the pipeline turns a prompt into model input and which hidden states it reads."""

    format_messages: Callable[[List[str]], list]  # the pipeline's chat messages for prompts
    max_length: int
    hidden_layers: Tuple[int, ...]  # indices into output.hidden_states (0 = embeddings)
    chat_options: dict = field(default_factory=dict)  # apply_chat_template's options (klein's Qwen)

    def key(self) -> dict:
        """What the template contributes to an embedding's cache key."""
        key = {
            "messages": self.format_messages(["\u0000prompt\u0000"]),
            "max_length": self.max_length,
            "hidden_layers": list(self.hidden_layers),
        }
        return {**key, "chat_options": self.chat_options} if self.chat_options else key


@dataclass(frozen=True)
class EncoderFolder:
    folder: Path
    config: dict  # config.json as written
    text_config: object  # transformers MistralConfig
    weight_files: Dict[str, Path]  # tensor name -> shard
    prefix: str  # language-model prefix of the tensor names
    headers: Dict[Path, dict]  # shard -> its parsed header, for the identity
    family: EncoderFamily = FAMILIES["mistral"]

    @property
    def hidden_size(self) -> int:
        return self.text_config.hidden_size

    @property
    def num_layers(self) -> int:
        return self.text_config.num_hidden_layers

    def identity(self) -> str:
        """sha256 over config.json, every shard's header and the tokenizer's files."""
        digest = hashlib.sha256(json.dumps(self.config, sort_keys=True).encode())
        for shard in sorted(self.headers, key=lambda p: p.name):
            digest.update(shard.name.encode() + b"\0")
            digest.update(json.dumps(self.headers[shard], sort_keys=True).encode())
        for name in TOKENIZER_FILES:
            path = self.folder / name
            if path.is_file():
                digest.update(name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        return digest.hexdigest()


def _fail(folder: Path, problem: str, fix: str) -> None:
    raise TextEncoderFolderError(f"text encoder folder {folder}: {problem}; {fix}")


def _weight_map(folder: Path) -> Dict[str, Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            _fail(folder, f"{INDEX_FILE} is not a safetensors index ({e})", "download it again")
        return {name: folder / shard for name, shard in weight_map.items()}
    if (folder / SINGLE_FILE).is_file():
        with StreamedSafetensors(folder / SINGLE_FILE) as st:
            return {name: folder / SINGLE_FILE for name in st.keys()}
    _fail(folder, f"neither {INDEX_FILE} nor {SINGLE_FILE} found", "point text_encoder_path at a "
          "snapshot of the model's encoder (safetensors weights)")


def _text_config(folder: Path, config: dict):
    from transformers import AutoConfig

    try:
        loaded = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as e:
        _fail(folder, f"config.json cannot be read ({e})", "download it again")
    text_config = getattr(loaded, "text_config", loaded)
    if getattr(text_config, "model_type", None) not in FAMILIES:
        _fail(folder, f"the language model is {getattr(text_config, 'model_type', None)!r}, not "
              f"{' or '.join(FAMILIES)}", "FLUX.2 needs the Mistral-Small-3.1 encoder, FLUX.2 klein its Qwen3")
    # from_pretrained's default on torch >= 2.1; the layers then attend with SDPA
    text_config._attn_implementation = "sdpa"
    return text_config


def open_encoder(folder, deepest_layer: int) -> EncoderFolder:
    """Validate an encoder folder for hidden states up to `deepest_layer`; nothing is loaded."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        _fail(folder, "no config.json", "point text_encoder_path at the text encoder's model folder")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text_config = _text_config(folder, config)
    family = FAMILIES[text_config.model_type]
    if deepest_layer > text_config.num_hidden_layers:
        _fail(folder, f"the pipeline reads hidden state {deepest_layer} but the encoder has "
              f"{text_config.num_hidden_layers} layers", "use the encoder the model was trained with")
    weight_files = _weight_map(folder)
    prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if p + "embed_tokens.weight" in weight_files), None)
    if prefix is None:
        _fail(folder, "no language-model embed_tokens.weight in the weights", "download the model again")
    needed = _needed_tensors(prefix, deepest_layer, text_config.num_hidden_layers, family.layer_tensors)
    missing = [name for name in needed if name not in weight_files]
    if missing:
        _fail(folder, f"{len(missing)} tensors missing from the weight map (e.g. {missing[:3]})",
              "download the model again")
    headers = _check_shards(folder, {weight_files[name] for name in weight_files}, needed, weight_files)
    return EncoderFolder(folder, config, text_config, weight_files, prefix, headers, family)


def _needed_tensors(prefix: str, deepest_layer: int, num_layers: int, layer_tensors: Sequence[str]) -> List[str]:
    names = [prefix + "embed_tokens.weight"]
    for index in range(deepest_layer):
        names += [f"{prefix}layers.{index}.{name}" for name in layer_tensors]
    if deepest_layer == num_layers:
        names.append(prefix + "norm.weight")  # the last hidden state is read after the final norm
    return names


def _check_shards(folder: Path, shards, needed: List[str], weight_files: Dict[str, Path]) -> Dict[Path, dict]:
    """Every shard present with a sound header that holds what the index says it holds."""
    headers = {}
    for shard in sorted(shards):
        if not shard.is_file():
            _fail(folder, f"shard {shard.name} named in {INDEX_FILE} is missing",
                  "download the missing file (or the whole snapshot) again")
        try:
            with StreamedSafetensors(shard) as st:
                header = st.header
        except SafetensorsHeaderError as e:
            _fail(folder, f"shard {shard.name} is damaged: {e}", "download that file again")
        headers[shard] = {
            "size": shard.stat().st_size,
            "metadata": header.metadata,
            "tensors": {n: [e.dtype, list(e.shape), e.begin, e.end] for n, e in header.entries.items()},
        }
    for name in needed:
        if name not in headers[weight_files[name]]["tensors"]:
            _fail(folder, f"{weight_files[name].name} lacks {name!r} although {INDEX_FILE} points there",
                  "download the model again")
    return headers


@dataclass(frozen=True)
class LayerInputs:
    """What every decoder layer gets besides the hidden states."""

    batches: List[Tuple[slice, Optional[torch.Tensor]]]  # rows of a micro-batch, its causal mask
    positions: torch.Tensor
    rotary: Tuple[torch.Tensor, torch.Tensor]  # cos, sin


class StreamedTextEncoder:
    """Hidden states of the encoder (Mistral, Qwen3), computed one decoder layer at a time."""

    def __init__(self, encoder: EncoderFolder, template: PromptTemplate, device,
                 dtype: torch.dtype = torch.bfloat16, micro_batch: int = 8,
                 log: Callable[[str], None] = print):
        self.encoder = encoder
        self.template = template
        self.device = torch.device(device)
        self.dtype = dtype
        self.micro_batch = micro_batch
        self.log = log
        self._tokenizer = None

    def tokenize(self, prompts: List[str]) -> Tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask exactly as the pipeline builds them: Mistral's processor
        tokenizes the chat itself; klein renders Qwen's chat template as text, then tokenizes it."""
        import transformers

        family = self.encoder.family
        if self._tokenizer is None:
            loader = getattr(transformers, family.tokenizer or "AutoProcessor")
            self._tokenizer = loader.from_pretrained(str(self.encoder.folder))
        padding = {"return_tensors": "pt", "padding": "max_length", "truncation": True,
                   "max_length": self.template.max_length}
        messages = self.template.format_messages(prompts)
        if family.tokenizer is None:
            inputs = self._tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True,
                                                         return_dict=True, **padding)
        else:
            texts = [self._tokenizer.apply_chat_template(chat, tokenize=False, **self.template.chat_options)
                     for chat in messages]
            inputs = self._tokenizer(texts, **padding)
        return inputs["input_ids"], inputs["attention_mask"]

    @torch.no_grad()
    def encode(self, prompts: List[str]) -> torch.Tensor:
        """[len(prompts), max_length, len(hidden_layers) * hidden] on the CPU, in self.dtype."""
        input_ids, attention_mask = self.tokenize(prompts)
        with contextlib.ExitStack() as stack:
            files = {shard: stack.enter_context(StreamedSafetensors(shard))
                     for shard in set(self.encoder.weight_files.values())}
            return self._run(files, input_ids, attention_mask)

    def _run(self, files, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        wanted = sorted(set(self.template.hidden_layers))
        hidden = self._embed(files, input_ids)
        inputs = self._layer_inputs(hidden, attention_mask)
        kept = {0: hidden.to("cpu", copy=True)} if 0 in wanted else {}
        for index in range(wanted[-1]):
            self.log(f" - text encoder layer {index + 1}/{wanted[-1]}")
            layer = self._layer(files, index)
            for rows, mask in inputs.batches:
                hidden[rows] = layer(hidden[rows], attention_mask=mask, position_ids=inputs.positions,
                                     position_embeddings=inputs.rotary)
            del layer
            if index + 1 in wanted:
                kept[index + 1] = (self._final_norm(files, hidden) if index + 1 == self.encoder.num_layers
                                   else hidden.to("cpu", copy=True))
        return torch.cat([kept[k] for k in self.template.hidden_layers], dim=-1)

    def _tensors(self, files, names: Sequence[str]) -> Dict[str, torch.Tensor]:
        """Named tensors in self.dtype, read shard by shard in file order."""
        by_shard: Dict[Path, List[str]] = {}
        for name in names:
            by_shard.setdefault(self.encoder.weight_files[name], []).append(name)
        out = {}
        for shard, shard_names in by_shard.items():
            out.update({n: t.to(self.dtype) for n, t in files[shard].read_many(shard_names).items()})
        return out

    def _embed(self, files, input_ids: torch.Tensor) -> torch.Tensor:
        """Look up only the table rows these prompts use."""
        name = self.encoder.prefix + "embed_tokens.weight"
        used, inverse = torch.unique(input_ids, return_inverse=True)
        rows = files[self.encoder.weight_files[name]].read_rows(name, used.tolist()).to(self.dtype)
        return rows.to(self.device)[inverse.to(self.device)]

    def _layer_inputs(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> "LayerInputs":
        """Positions, rotary tables and one causal mask per micro-batch, as MistralModel builds them."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        config = self.encoder.text_config
        cache_position = torch.arange(hidden.shape[1], device=self.device)
        positions = cache_position.unsqueeze(0)
        rotary = self.encoder.family.modeling("RotaryEmbedding")(config=config, device=self.device)
        if self.encoder.family.rotary_in_compute_dtype:  # the fork moves the whole encoder, buffer included
            rotary = rotary.to(dtype=self.dtype)
        make_mask = create_causal_mask if config.sliding_window is None else create_sliding_window_causal_mask
        batches = []
        for start in range(0, hidden.shape[0], self.micro_batch):
            rows = slice(start, start + self.micro_batch)
            mask = make_mask(config=config, input_embeds=hidden[rows], attention_mask=attention_mask[rows].to(self.device),
                             cache_position=cache_position, past_key_values=None, position_ids=positions)
            batches.append((rows, mask))
        return LayerInputs(batches, positions, rotary(hidden, positions))

    def _layer(self, files, index: int) -> torch.nn.Module:
        prefix = f"{self.encoder.prefix}layers.{index}."
        with torch.device("meta"):
            layer = self.encoder.family.modeling("DecoderLayer")(self.encoder.text_config, index)
        state = self._tensors(files, [prefix + name for name in self.encoder.family.layer_tensors])
        layer.load_state_dict({name[len(prefix):]: t for name, t in state.items()}, assign=True)
        del state
        return layer.to(self.device).eval()

    def _final_norm(self, files, hidden: torch.Tensor) -> torch.Tensor:
        config = self.encoder.text_config
        with torch.device("meta"):
            norm = self.encoder.family.modeling("RMSNorm")(config.hidden_size, eps=config.rms_norm_eps)
        name = self.encoder.prefix + "norm.weight"
        norm.load_state_dict({"weight": self._tensors(files, [name])[name]}, assign=True)
        return norm.to(self.device)(hidden).cpu()


def encode_in_groups(encoder: StreamedTextEncoder, prompts: List[str], group_size: int
                     ) -> Iterator[Tuple[str, torch.Tensor]]:
    """(prompt, [max_length, width]) for every prompt, `group_size` prompts per pass over the weights."""
    for start in range(0, len(prompts), group_size):
        group = prompts[start:start + group_size]
        if len(prompts) > group_size:
            encoder.log(f"text phase: prompts {start + 1}-{start + len(group)} of {len(prompts)}")
        embeds = encoder.encode(group)
        for prompt, embed in zip(group, embeds):
            yield prompt, embed.clone()
        del embeds


def group_size_for(encoder: EncoderFolder, template: PromptTemplate, budget_bytes: int) -> int:
    """How many prompts one pass can carry when their hidden states may use `budget_bytes`."""
    per_prompt = template.max_length * encoder.hidden_size * 2 * (1 + len(template.hidden_layers))
    return max(1, budget_bytes // per_prompt)
